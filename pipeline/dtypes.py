"""The dtypes, in one table: the training/export dtypes with their bytes, safetensors code and the
tolerances of every comparison made in them, and every safetensors code the checkpoint reader knows."""

from __future__ import annotations

from dataclasses import dataclass

# safetensors dtype codes by torch dtype name (the format's own names).
SAFETENSORS_CODES = {"float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64",
                     "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                     "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
SAFETENSORS_NAMES = {code: name for name, code in SAFETENSORS_CODES.items()}


@dataclass(frozen=True)
class Dtype:
    """A dtype runs train and export in. Tolerances are relative to what is compared (see each user)."""

    name: str
    bytes: int
    export_loss: float  # verify: step-1 loss of the export vs plain transformers on the source (absolute)
    logged_loss: float  # verify: the run's logged step-1 loss vs plain transformers (absolute)
    kernel: float  # verify-kernels: max error relative to the reference's largest magnitude

    @property
    def safetensors(self) -> str:
        return SAFETENSORS_CODES[self.name]


# export_loss: fp32 is the same arithmetic (measured 5e-7 on tiny), bf16 rounds every weight (measured
# 4e-5 on tiny; looser for depth). logged_loss: the run's own arithmetic vs plain transformers', by training
# precision. kernel: a replacement computing in bf16 (8 significant bits, relative rounding 2^-8 ≈ 0.4 %)
# vs a float32 reference.
DTYPES = {d.name: d for d in (Dtype("float32", 4, export_loss=1e-5, logged_loss=1e-4, kernel=1e-5),
                              Dtype("bfloat16", 2, export_loss=2e-2, logged_loss=2e-2, kernel=2e-2))}
NAMES = tuple(DTYPES)


def by_code(code: str) -> Dtype | None:
    """The training dtype a safetensors code names (None for any other code)."""
    return DTYPES.get(SAFETENSORS_NAMES.get(code, ""))
