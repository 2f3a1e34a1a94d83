"""Starting fleets: the CLI and the local process launcher."""
