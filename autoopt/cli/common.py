"""What every command shares: the MODEL and ``--input`` options, loading both, sizes, pass
names, dynamic dimensions, and checking an output path before the work starts."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoopt.cli.names import PASS_NAMES
from autoopt.cli.progress import output, stage
from autoopt.errors import ConfigError

if TYPE_CHECKING:  # imported where used: building the parsers (--help) imports no torch
    import torch
    from torch import nn

MODEL_HELP = "package.module:factory, path/to/file.py:Name, or model.pt2"
INPUT_HELP = ("an example input, e.g. 1x3x224x224 or input_ids=1x128:int64; repeat for several "
              "inputs (named ones are passed as keywords)")
VERBOSE_HELP = "print each step and the library's log as it happens, with the time taken"
# What ``--dynamic`` may name; ``batch`` and ``sequence`` mean what they mean to export_onnx:
#   batch     dim 0 of every tensor input,
#   sequence  dim 1 of every integer or bool input with two or more (token ids, masks),
#   all       every dimension the model lets vary (what a bare --dynamic means).
DYNAMIC_CHOICES = ("batch", "sequence", "all")
DYNAMIC_HELP = ("leave a dimension symbolic: batch (dim 0 of every input), sequence (dim 1 of "
                "integer inputs), all (every dimension the model lets vary; what --dynamic "
                "alone means); repeatable")


def add_model_arguments(parser: argparse.ArgumentParser, *, inputs_required: bool = True,
                        device: str | None = None, device_help: str = "cpu, cuda, cuda:N",
                        ) -> None:
    """MODEL, ``--input``, ``--dtype``, ``--int-high``, ``--threads``, ``-v`` (and ``--device``
    unless ``device`` is ``"none"``), worded the same for every command."""
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--input", action="append", required=inputs_required,
                        default=None if inputs_required else [],
                        metavar="[NAME=]SHAPE[:DTYPE]", help=INPUT_HELP)
    parser.add_argument("--dtype", default="float32", help="dtype of inputs that name none")
    parser.add_argument("--int-high", type=int, default=100,
                        help="integer inputs are drawn from [0, INT_HIGH) (token ids)")
    if device != "none":
        parser.add_argument("--device", default=device, help=device_help)
    add_common_arguments(parser)


def add_common_arguments(parser: argparse.ArgumentParser,
                         threads_help: str = "torch.set_num_threads") -> None:
    parser.add_argument("--threads", type=int, default=None, help=threads_help)
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)


def load_workload(args: argparse.Namespace, *, train: bool | None = None,
                  dynamic: Sequence[str] = (),
                  ) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The preamble of every command that takes a MODEL: threads, the model (in train mode
    when ``train`` is True, eval when False, as it comes when None) and random inputs from
    the ``--input`` specs; a size of 1 in a ``dynamic`` dimension (``batch``, ``sequence``)
    is drawn as 2, said on stdout, since export would fix it."""
    from autoopt.cli.loading import load_model, model_inputs, widened_for_dynamic

    set_threads(args.threads)
    stage(f"loading {args.model}")
    model = load_model(args.model)
    if train is not None:  # a program's ops are as exported; its flags choose the capture
        model.train(train)
    specs, notes = widened_for_dynamic(list(args.input), tuple(dynamic), args.dtype)
    for note in notes:
        output(note)
    inputs, kwargs = model_inputs(specs, args.dtype, args.int_high)
    return model, inputs, kwargs


def check_threads(threads: int | None) -> int | None:
    """``--threads`` as given; 0 or fewer is an error (0 was taken as "leave it", silently)."""
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads {threads} is not a thread count: give 1 or more")
    return threads


def set_threads(threads: int | None) -> None:
    """``--threads``: PyTorch's thread count (None: leave it)."""
    import torch

    if check_threads(threads) is not None:
        torch.set_num_threads(threads)


def parse_size(option: str, text: str) -> int:
    """``--memory 16GiB`` -> bytes, through the library's one size parser."""
    from autoopt.options.memory import parse_budget

    try:
        size = parse_budget(text)
    except ConfigError as exc:
        raise ConfigError(f"{option} {text!r} is not a size; write e.g. 16GiB, 512MiB or 8GB "
                          f"(units: B, KB, MB, GB, KiB, MiB, GiB)") from exc
    return int(size)


def parse_budget_option(text: str) -> int | float | str:
    """``--memory-budget``: bytes (``8000000000``), a fraction of device memory (``0.5``) or a
    size (``8GiB``), checked now with the library's parser and passed on as the library
    takes it."""
    from autoopt.options.memory import parse_budget

    value: int | float | str = text
    for kind in (int, float):
        try:
            value = kind(text)
            break
        except ValueError:
            continue
    try:
        parse_budget(value)
    except ConfigError as exc:
        raise ConfigError(f"--memory-budget {text!r}: {exc}") from exc
    return value


def pass_name(text: str) -> list[str]:
    """``--disable`` values: one pass name or several, comma-separated, each a real pass."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PASS_NAMES]
    if unknown or not names:
        given = ", ".join(map(repr, unknown or [text]))
        raise argparse.ArgumentTypeError(f"unknown pass {given}; the passes are "
                                         f"{', '.join(PASS_NAMES)}")
    return names


def add_disable_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disable", action="append", type=pass_name, default=[],
                        metavar="PASS", help=f"leave passes out (repeatable or comma-separated): "
                                             f"{', '.join(PASS_NAMES)}")


def disabled(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(name for names in args.disable for name in names)


def add_dynamic_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dynamic", action="append", nargs="?", const="all", default=[],
                        choices=DYNAMIC_CHOICES, metavar="{batch,sequence,all}",
                        help=DYNAMIC_HELP)


def named_dynamic_shapes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                         dims: Sequence[str]) -> Any:
    """A ``torch.export`` ``dynamic_shapes`` that leaves ``batch`` and/or ``sequence``
    symbolic (the same rule as ``export_onnx``'s ``dynamic=``)."""
    import torch

    from autoopt.capture.graph import dynamic_shapes_for
    from autoopt.errors import InputError

    def tensor_dims(value: torch.Tensor) -> dict[int, Any] | None:
        found = {}
        if "batch" in dims and value.dim() >= 1:
            found[0] = "batch"
        if ("sequence" in dims and value.dim() >= 2
                and not (value.is_floating_point() or value.is_complex())):
            found[1] = "sequence"
        for d, name in found.items():
            if value.shape[d] < 2:  # export would specialize a size of 0 or 1
                raise InputError(f"--dynamic {name} is dimension {d} of an example input of "
                                 f"shape {tuple(value.shape)}, whose size {value.shape[d]} "
                                 f"export would fix; use an example with a size of at least "
                                 f"2 there.")
        return {d: torch.export.Dim.DYNAMIC for d in found} or None

    return dynamic_shapes_for(model.forward, args, kwargs, tensor_dims)


def check_output(value: str | None, option: str) -> None:
    """Make the output's folder and check the file can be written, so that a bad path fails
    in a second, not after minutes of optimizing and measuring."""
    from autoopt.onnx.signature import check_writable

    if not value:
        return
    path = Path(value)
    if path.is_dir():
        raise ConfigError(f"{option} {value!r} is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{option} {value!r}: cannot create the folder {str(path.parent)!r} "
                          f"({exc.strerror or exc}); choose a writable path.") from exc
    check_writable(path, f"{option} {value!r}")
