"""The step program's signature (vktrain/export/step_graph.py `_StepSignature`): its buffer lookups are
computed once only while ExportedProgram validates it, and follow the specs everywhere else."""
from __future__ import annotations

from torch.export.graph_signature import InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument

from vktrain.export.step_graph import _StepSignature


def _signature(names):
    inputs = [InputSpec(InputKind.BUFFER, TensorArgument(f"b_{n}"), n, True) for n in names]
    outputs = [OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(f"new_{n}"), n) for n in names]
    return _StepSignature(inputs, outputs)


def test_lookups_are_computed_once_in_the_context_and_follow_the_specs_outside():
    signature = _signature(["a", "b"])
    with signature.lookups_computed_once():
        first = signature.buffers_to_mutate
        assert signature.buffers_to_mutate is first and signature.buffers is signature.buffers
        assert dict(first) == {"new_a": "a", "new_b": "b"} and tuple(signature.buffers) == ("a", "b")
    signature.input_specs.pop()
    signature.output_specs.pop()
    assert tuple(signature.buffers) == ("a",)
    assert dict(signature.buffers_to_mutate) == {"new_a": "a"}
