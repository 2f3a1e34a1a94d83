"""The job service (``tensorfleet serve``): jobs that outlive a terminal session, kept in a SQLite store."""
