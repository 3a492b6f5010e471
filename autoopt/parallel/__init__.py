"""Pipeline parallelism: stages emitted from the partitioned graph (``stages``), the microbatch
split and merge (``microbatches``), the orders they run in (``schedules``), planning the cut
(``planning``), and running the stages locally over devices (``pipeline``) or one per process
under ``torch.distributed.pipelining`` (``distributed``); ``plot`` draws a cut."""
