"""Which model instance a Triton stub is, and where its engine runs.

Each instance of the `specguide` model (config.pbtxt `instance_group`) is a Python backend stub
process of its own with an engine process of its own: its own weights, slots, KV cache, compile
workers. Triton names an instance `<group>_<n>` (the group's name defaults to
`<model>_<group index>`): `specguide_0_0`, `specguide_0_1` for `count: 2`. A KIND_GPU group makes
`count` instances per listed GPU, and instances on different GPUs share a name, so the metric
label (`label`) adds the GPU: `specguide_0_0_gpu1`.

Where the engine runs follows the instance's kind: KIND_GPU on that instance's GPU (`cuda:<id>`),
KIND_CPU on the CPU, KIND_MODEL where the `device` setting says (`auto`: CUDA when present). A
`device` setting that contradicts the kind is a configuration error, not a silent second engine
on the same device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

KINDS = ("CPU", "GPU", "MODEL")


@dataclass(frozen=True)
class Instance:
    """One model instance, as Triton's `initialize(args)` describes it."""

    name: str  # args["model_instance_name"], e.g. "specguide_0_1"
    kind: str  # "CPU" | "GPU" | "MODEL"
    device_id: int  # the GPU of a KIND_GPU instance (0 otherwise)

    @classmethod
    def from_args(cls, args: Mapping[str, str], model_name: str = "specguide") -> "Instance":
        """From the stub's `args` (a test's fake args may leave the instance keys out)."""
        kind = str(args.get("model_instance_kind", "MODEL")).upper()
        return cls(name=str(args.get("model_instance_name") or f"{model_name}_0_0"),
                   kind=kind if kind in KINDS else "MODEL",
                   device_id=int(args.get("model_instance_device_id", 0) or 0))

    @property
    def label(self) -> str:
        """The value of the `model_instance` metric label: unique among the instances of one server."""
        return f"{self.name}_gpu{self.device_id}" if self.kind == "GPU" else self.name

    def engine_device(self, device: str) -> str:
        """The engine's `device` setting for this instance; ValueError when `device` contradicts the kind."""
        if self.kind == "MODEL":
            return device
        if self.kind == "CPU":
            if device not in ("auto", "cpu"):
                raise ValueError(f"instance {self.name} is KIND_CPU but the setting device is {device!r}: "
                                 "set device to auto or cpu, or use KIND_GPU / KIND_MODEL")
            return "cpu"
        own = f"cuda:{self.device_id}"
        if device not in ("auto", "cuda", own):
            raise ValueError(f"instance {self.name} is KIND_GPU on GPU {self.device_id} but the setting device is "
                             f"{device!r}: set device to auto (each instance then runs on its own GPU)")
        return own


def instance_count(model_config: dict) -> int:
    """How many instances (one stub each) Triton makes of a model from its config's `instance_group`:
    `count` per group, per listed GPU for KIND_GPU; 1 without a group."""
    total = 0
    for group in model_config.get("instance_group") or []:
        count = int(group.get("count", 1) or 1)
        gpus = group.get("gpus") or []
        total += count * (len(gpus) if str(group.get("kind", "")).endswith("GPU") and gpus else 1)
    return max(total, 1)
