"""How long each node takes and how much memory it holds on the target device.

The cost model is the one place in autoopt that measures. Passes read it through
``PassContext.cost``: ``cost.estimate(node)`` for one node (a cached measurement, else a
calibrated roofline), ``cost.profile(gm, inputs)`` to time every node on the device,
``cost.predict(gm, nodes)`` for a whole graph or a pipeline stage.
"""

from .cache import CostCache, default_cache_dir
from .device import Ceilings, DeviceInfo, device_info
from .model import CostModel, GraphCost, NodeCost

__all__ = ["Ceilings", "CostCache", "CostModel", "DeviceInfo", "GraphCost", "NodeCost",
           "default_cache_dir", "device_info"]
