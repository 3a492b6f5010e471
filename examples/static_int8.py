"""Static int8 with calibration: a CNN's convolutions in int8, activation scales calibrated on
a few batches by the engines' own quantizers (NNCF for OpenVINO, ONNX Runtime's QDQ), the
faster verified one kept (README "Reduced precision", docs/precision.md).

Where no engine's int8 stays within the tolerance, optimize raises a ConfigError naming the
ops int8 errs at most.
"""

import torch
import torchvision

import autoopt

model = torchvision.models.resnet18(num_classes=10).eval()
x = torch.randn(2, 3, 64, 64)
batches = [torch.randn(2, 3, 64, 64) for _ in range(16)]  # or a DataLoader of inputs
with torch.no_grad():
    fast = autoopt.optimize(model, (x,), precision="int8", calibration=batches,
                            backends=("openvino", "onnxruntime"))
    print(fast.report.backends[0].describe())  # the engine, the ops in int8, the error
    y = fast(x)
