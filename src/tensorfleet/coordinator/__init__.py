"""In-graph replication across machines: one program, the coordinator, drives a fleet of ps and workers
(``Coordinator``, as TensorFlow 2's ``ClusterCoordinator``). See ``coordinator.py`` for the coordinator,
``worker.py`` for what a worker does, ``remote.py`` for how functions are named, and ``run.py`` for the entry
point a script calls on every task."""
