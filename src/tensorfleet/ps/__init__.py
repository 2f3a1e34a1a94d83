"""The parameter server: variable store, optimizer apply, RPC adapter, process entry."""
