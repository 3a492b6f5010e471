"""Pipeline parallelism: stages emitted from the partitioned graph, run locally over devices
(``pipeline``) or one per process under ``torch.distributed.pipelining`` (``distributed``)."""
