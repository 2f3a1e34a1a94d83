"""The worker side: sharded concurrent client and the module <-> remote variables binding."""
