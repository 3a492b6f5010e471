import torch
import torchvision

import autoopt

model = torchvision.models.resnet18().eval()
x = torch.randn(1, 3, 64, 64)
fast = autoopt.optimize(model, (x,))          # your model object is never modified
print(fast.report)                            # capture method, passes, verification, backend
with torch.no_grad():                         # inference: call under torch.no_grad()
    torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    y = fast(torch.randn(4, 3, 64, 64))       # a new shape is captured and verified anew
