"""The worker <-> ps contract: everything a ps is told, asked and answers, in one package.

Everything that crosses between a worker (``tensorfleet.worker``, ``train``, ``parallel``), the
launcher and a ps shard (``tensorfleet.ps``) is defined here and nowhere else:

* ``specs``: what a job is made of: ``Mode``, ``OptimizerSpec`` (with its learning-rate schedule),
  ``SyncOptions``, the NaN/Inf policy, and embedding tables (``TableSpec``, ``RowInitializer``);
* ``state``: a shard's whole state (``ShardState``, ``TableState``): what Snapshot answers, what a
  restore sends and what checkpoints hold; ``statekeys``: its flat key scheme (``value/<var>``, ...), in
  plain Python, written and parsed there only (``tensorfleet ckpt`` reads headers with it, without torch);
* ``messages``: one typed request per method and the typed replies, a push's ``Origin`` (exactly
  once) and a ``Cut`` (one point of the fleet's push order):

  ===========  =====================  ====================  ========================
  method       request                reply                 plane
  ===========  =====================  ====================  ========================
  Init         ``InitRequest``        ``InitReply``         control (gRPC)
  Pull         ``PullRequest``        ``StepReply``         data (TCP/shared memory)
  Lookup       ``LookupRequest``      ``StepReply``         data (rows of embedding tables)
  Push         ``PushRequest``        ``PushReply``         data
  Fence        ``FenceRequest``       ``Cut``               data (the chief: checkpoints, restores)
  Snapshot     ``SnapshotRequest``    ``SnapshotReply``     data (and control) + the ``ShardState``
  Status       -                      ``PsStatus``          control (workers, launcher, dashboards)
  Done         ``DoneRequest``        ``DoneReply``         control
  Resize       ``ResizeRequest``      ``ResizeReply``       control (the launcher's, not a worker's)
  Rendezvous   ``RendezvousRequest``  ``RendezvousReply``   control (ps 0: hybrid mode's workers meet)
  Run          ``RunRequest``         ``RunReply``          control (coordinator -> worker, ``closures``)
  ===========  =====================  ====================  ========================

* ``closures``: in-graph replication's Run (a coordinator asks a worker to run one of the script's remote
  functions, named) and how its arguments and results travel (JSON, tensors, per-worker values);
* ``placement``: placing a model's parts (a chief builds modules in its workers by name, runs their forward and
  backward there, steps their optimizers): Join, Place, Forward, Backward, Optimizer, Step, State, LoadState;
* ``averages``: the moving-average rule every holder of averages applies (the ps; hybrid mode's workers);
* ``status``: what a task answers to Status (``PsStatus``, ``WorkerStatus``), for workers, the launcher and
  dashboards; read strictly (``from_meta``) or, by the launcher's monitor, leniently (``read``: a junk
  field is None and reported, the others kept);
* ``meta``: the codec they are all built on. Each message builds its ``meta`` (the JSON head of a
  wire message) with ``to_meta`` and is parsed back with ``from_meta``, which checks every field
  and raises ``InvalidArgumentError`` naming the method and the field: the sender only builds, the
  receiver only parses, and neither writes a field name the other does not. Tensors travel beside
  the meta (see ``tensorfleet.wire``).

Only the standard library, torch, numpy and ``tensorfleet.errors`` / ``cluster`` / ``wire.codec``
are used here: the ps and the worker import this package, never the other way round.
"""
