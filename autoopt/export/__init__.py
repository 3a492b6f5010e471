"""Files for other runtimes: ONNX (export, verification under ONNX Runtime, the session, per
stage) and ``torch.export`` programs (``.pt2``)."""
