"""Operations: the transactional functions of the queue, one owner for each decision.

Rule: entry points (``producer``, ``consumer``, ``supervisor``, the CLI, the broker,
Spark) call operations; operations call the keyspace (``fdq.keyspace``: every key,
every codec) and the engine (``fdq.engine``: the one retry loop). Nothing else builds a
key, sizes a transaction, routes a message or writes a retry loop.

* :mod:`.routing`: where a message goes (its shard and dispatch tag).
"""
