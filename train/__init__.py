"""Training of the learned KVpop eviction scorer (installed as `kvjax.train`).

Empty until the KVpop issue lands: targets, scorers, loss, optax loop, orbax checkpoints.
"""
