"""ONNX files, shared by the ONNX Runtime and OpenVINO backends and by ``export_onnx``: writing
a graph (``writer``) with its input and output names (``signature``) and attention in ONNX's
own ops (``attention``), a graph as a file (``graph``), files kept between runs (``cache``), and
the ONNX Runtime session that serves one (``session``)."""
