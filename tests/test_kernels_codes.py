"""Numbers the shaders share with Python come from one table: runtime_shaders/codes.glsl is generated
from the elementwise op codes (kernels/elementwise.py) and the hparams layout (vktrain/contract.py)."""
from __future__ import annotations

import re

from vktrain import contract
from vktrain.backend.kernel_planning.kernels import elementwise, shader_codes

SHADERS = shader_codes.OUTPUT.parent


def test_codes_glsl_is_up_to_date():
    assert shader_codes.main(["--check"]) == 0


def test_shaders_use_the_generated_names_not_numbers():
    source = (SHADERS / "elementwise.slang").read_text()
    assert '#include "codes.glsl"' in source
    assert re.findall(r"case\s+\d+u?\s*:", source) == []  # every case label is a generated EW_* name
    labels = set(re.findall(r"case\s+(EW_\w+)\s*:", source))
    assert labels == ({f"EW_UNARY_{n.upper()}" for n in elementwise.UNARY_OPS}
                      | {f"EW_BINARY_{n.upper()}" for n in elementwise.BINARY_OPS})
    adamw = (SHADERS / "adamw.slang").read_text()
    assert re.findall(r"hparams\[\d+\]", adamw) == []
    assert {f"HPARAM_{n.upper()}" for n in contract.HPARAM_NAMES} <= set(re.findall(r"hparams\[(\w+)\]", adamw))


def test_render_numbers_every_code_once():
    defines = dict(re.findall(r"#define (\w+) (\w+)", shader_codes.render()))
    assert defines["EW_UNARY_RSUB_SCALAR"] == f"{elementwise.UNARY_OPS['rsub_scalar']}u"
    assert defines["HPARAM_WEIGHT_DECAY"] == str(contract.HPARAM_NAMES.index("weight_decay"))
    assert defines["HPARAM_COUNT"] == str(len(contract.HPARAM_NAMES))
