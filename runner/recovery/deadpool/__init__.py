"""DeadPool: hot spares take a lost rank's place; ZeRO-1 optimizer shards are replicated to a neighbour
every step (``replicator``, driven around each update by ``replication``) so that a spare gets the lost
shard without a checkpoint (``shard_state``, ``reconcile``). ``worker`` gives the worker its hooks. The
spare pool itself lives in the controller and the node agents."""
