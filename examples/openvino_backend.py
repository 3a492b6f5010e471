"""OpenVINO as one of the backends optimize measures (docs/openvino.md).

The openvino candidate compiles autoopt's ONNX file for the CPU in f32; the report lists each
candidate's measured time, and the fastest verified one runs the calls.
"""

import torch
import torchvision

import autoopt

model = torchvision.models.resnet18().eval()
x = torch.randn(2, 3, 64, 64)
fast = autoopt.optimize(model, (x,), backends=("aten", "openvino"))
with torch.no_grad():
    torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
print(fast.report.backends[0].chosen, fast.report.backends[0].seconds)
