"""A step's records: from a tensor a hook sees to the step handed to the writer thread.

``flatten.py`` names where each tensor sits in nested inputs and outputs (its slot);
``observe.py`` is the hot path, a tensor becoming a record queued in the step; ``params.py``
the parameters, buffers and their gradients, taken together; ``shards.py`` a DTensor's local
shard and what it is a part of; ``staging.py`` small tensors'
values copied aside for the writer; ``layout.py`` what a record says apart from its values;
``pending.py`` one step's observations, finished in the writer thread.

May import: stats.
"""
