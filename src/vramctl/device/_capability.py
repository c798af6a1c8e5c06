"""CUDA compute capability and the features it implies."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ComputeCapability"]

_ARCH = {
    (6, 0): "Pascal",
    (6, 1): "Pascal",
    (7, 0): "Volta",
    (7, 2): "Volta",
    (7, 5): "Turing",
    (8, 0): "Ampere",
    (8, 6): "Ampere",
    (8, 7): "Ampere",
    (8, 9): "Ada Lovelace",
    (9, 0): "Hopper",
    (10, 0): "Blackwell",
    (10, 3): "Blackwell",
    (12, 0): "Blackwell",
}


@dataclass(frozen=True, order=True)
class ComputeCapability:
    """A CUDA compute capability such as 8.6, with derived feature flags.

    >>> cc = ComputeCapability.parse("8.9")
    >>> cc.bf16, cc.tf32, cc.fp8, cc.architecture
    (True, True, True, 'Ada Lovelace')
    """

    major: int
    minor: int

    @classmethod
    def parse(cls, text: str) -> ComputeCapability:
        """Parse ``"8.6"`` (or ``"sm_86"``) into a capability."""
        raw = text.strip().lower().removeprefix("sm_").removeprefix("sm")
        if "." in raw:
            major, _, minor = raw.partition(".")
        elif raw.isdigit() and len(raw) >= 2:
            major, minor = raw[:-1], raw[-1]
        else:
            raise ValueError(f"invalid compute capability {text!r}: use a form like 8.6 or sm_86")
        return cls(int(major), int(minor))

    @property
    def bf16(self) -> bool:
        """Native bfloat16 arithmetic (Ampere and later)."""
        return self >= ComputeCapability(8, 0)

    @property
    def tf32(self) -> bool:
        """TensorFloat-32 tensor cores (Ampere and later)."""
        return self >= ComputeCapability(8, 0)

    @property
    def fp16_tensor_cores(self) -> bool:
        """fp16 tensor cores (Volta and later)."""
        return self >= ComputeCapability(7, 0)

    @property
    def fp8(self) -> bool:
        """FP8 tensor cores (Ada Lovelace 8.9, Hopper 9.0 and later)."""
        return self >= ComputeCapability(8, 9)

    @property
    def flash_attention(self) -> bool:
        """PyTorch's flash SDPA kernel (needs sm80 or later)."""
        return self >= ComputeCapability(8, 0)

    @property
    def architecture(self) -> str:
        if (self.major, self.minor) in _ARCH:
            return _ARCH[(self.major, self.minor)]
        known = [k for k in _ARCH if k[0] == self.major]
        return _ARCH[known[0]] if known else "unknown"

    def features(self) -> dict[str, bool]:
        return {
            "bf16": self.bf16,
            "tf32": self.tf32,
            "fp16_tensor_cores": self.fp16_tensor_cores,
            "fp8": self.fp8,
            "flash_attention": self.flash_attention,
        }

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"
