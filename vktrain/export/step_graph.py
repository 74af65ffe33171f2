"""The training-step program, built from the joint graph by editing it (no second torch.export).

The joint graph (loss + the gradient of every trainable tensor) is already functional core ATen. The step
adds, per trainable tensor, one vktrain.adamw over (param, exp_avg, exp_avg_sq, grad, hparams, step + 1) and
returns the updated state as buffer mutations. Writing those few hundred nodes into the joint graph
directly gives the program a second torch.export (plus its functionalisation) would trace, in
milliseconds instead of minutes for a 30-layer model: the new nodes' metadata comes from running their
ops on the joint graph's fake tensors. The signature follows vktrain/export/training.py's docstring:

    inputs   state buffers in this order: model.<path> (every tensor the joint graph reads, in its order;
             lifted constants as constants.<name>, non-persistent), optimizer.step,
             optimizer.exp_avg.<trainable path>..., optimizer.exp_avg_sq.<trainable path>...; then the user
             inputs: the loss's inputs and hparams (step_input_names)
    outputs  the buffer mutations (trainable tensors in state order, step, exp_avg..., exp_avg_sq...), then
             the loss
"""
from __future__ import annotations

import copy
import operator
from contextlib import contextmanager

import torch
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec,
                                          TensorArgument)

from vktrain.contract import (EVAL_INPUTS, EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, GRAD_ACC_PREFIX, HPARAM_NAMES, HPARAMS, MODEL_PREFIX,
                              STEP_INPUTS, STEP_STATE)
from vktrain.errors import VktrainError

# The token models' loss inputs (the eval method's); their step takes STEP_INPUTS, hparams before n_valid.
_JOINT_USER_INPUTS = EVAL_INPUTS


class StepInputError(VktrainError, ValueError):
    """A loss whose inputs the step cannot take as they are (a name the step gives its own input)."""


def step_input_names(loss_inputs: tuple[str, ...]) -> tuple[str, ...]:
    """The step program's user inputs for a loss taking `loss_inputs`: those, then hparams; a token
    model's loss (token_ids, labels, n_valid) gives contract.STEP_INPUTS (hparams before n_valid)."""
    if HPARAMS in loss_inputs:
        raise StepInputError(f"the loss takes an input named {HPARAMS!r} (inputs {list(loss_inputs)}); the "
                             f"training step adds its own {HPARAMS!r} input: rename the loss's parameter")
    return STEP_INPUTS if loss_inputs == _JOINT_USER_INPUTS else loss_inputs + (HPARAMS,)


_IDENTITY_OPS = (torch.ops.aten.alias.default, torch.ops.aten.detach.default)


def simplify_joint_graph(graph: torch.fx.Graph) -> None:
    """Drop artifacts of the joint graph that would otherwise become GPU ops: identities (`aten.alias`,
    `aten.detach`) and the loss seed `full_like(loss, 1) * g` (a multiplication by one)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _IDENTITY_OPS:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.mul.Tensor:
            continue
        for seed, other in (node.args, node.args[::-1]):
            if (isinstance(seed, torch.fx.Node) and isinstance(other, torch.fx.Node)
                    and seed.target is torch.ops.aten.full_like.default and seed.args[1] == 1
                    and other.meta["val"].shape == node.meta["val"].shape
                    and other.meta["val"].dtype == node.meta["val"].dtype):
                node.replace_all_uses_with(other)
                graph.erase_node(node)
                break
    graph.eliminate_dead_code()


class _StepBuilder:
    """Edits the joint program's graph in place into the step's; `build` returns the step program."""

    def __init__(self, joint: ExportedProgram, trainable: list[str], grad_accum: bool = False) -> None:
        self.joint = joint
        self.trainable = trainable
        self.grad_accum = grad_accum  # the step reads grad_acc.<path> state (added to its gradient) and zeroes it
        self.graph = joint.graph_module.graph
        self.placeholders = [node for node in self.graph.nodes if node.op == "placeholder"]
        self.fake_mode = detect_fake_mode([node.meta["val"] for node in self.placeholders])
        self.state_specs: list[InputSpec] = []
        self.state_dict: dict[str, torch.Tensor] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.node_of: dict[str, torch.fx.Node] = {}  # state FQN -> placeholder

    def _fake(self, make):
        # Below autograd: the fake inputs need no gradient, and the custom ops' autograd wrappers would
        # cost milliseconds per call.
        with self.fake_mode, torch._C._AutoDispatchBelowADInplaceOrView():
            return make()

    def _joint_state(self) -> list[torch.fx.Node]:
        """The joint graph's parameters, buffers and lifted constants, renamed as the step's state; returns
        the user-input placeholders (the loss's inputs)."""
        user_inputs = []
        for node, spec in zip(self.placeholders, self.joint.graph_signature.input_specs):
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                # _LossModule holds the model as `model`, so targets already read "model.<path>".
                source = self.joint.state_dict[spec.target] if spec.target in self.joint.state_dict \
                    else self.joint.constants[spec.target]
                # The trainable tensors are the step's mutable state: its own copy, so that running the step
                # in torch (program.module()) changes no other program's constants (the eval method's).
                trained = spec.target.removeprefix(MODEL_PREFIX) in self.trainable
                self._add_state(node, spec.target, source.detach().clone() if trained else source.detach(),
                                persistent=True)
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                self._add_state(node, "constants." + spec.target.replace(".", "_"),
                                self.joint.constants[spec.target].detach(), persistent=False)
            elif spec.kind == InputKind.USER_INPUT:
                user_inputs.append(node)
            else:
                raise NotImplementedError(f"joint graph input of kind {spec.kind} ({spec.target}) is not handled")
        return user_inputs

    def _add_state(self, node: torch.fx.Node, fqn: str, tensor: torch.Tensor, persistent: bool) -> None:
        self.state_specs.append(InputSpec(InputKind.BUFFER, TensorArgument(node.name), fqn, persistent))
        (self.state_dict if persistent else self.constants)[fqn] = tensor
        self.node_of[fqn] = node

    def _new_state(self, fqn: str, before: torch.fx.Node, like: torch.Tensor) -> None:
        with self.graph.inserting_before(before):
            node = self.graph.placeholder("b_" + fqn.replace(".", "_").lower())
        node.meta["val"] = self._fake(lambda: torch.empty_like(like))
        self._add_state(node, fqn, torch.zeros_like(like), persistent=True)

    def _call(self, target, args: tuple) -> torch.fx.Node:
        node = self.graph.call_function(target, args)
        fake_args = pytree.tree_map_only(torch.fx.Node, lambda n: n.meta["val"], args)
        node.meta["val"] = self._fake(lambda: target(*fake_args))
        return node

    def _gradients(self) -> tuple[torch.fx.Node, dict[str, torch.fx.Node]]:
        loss, grads = _loss_and_gradients(self.joint)
        missing = [p for p in self.trainable if p not in grads]
        extra = sorted(set(grads) - set(self.trainable))
        if missing or extra:
            raise StepInputError(f"the joint graph's gradients do not match the trainable parameters: missing "
                                 f"{missing} (a trainable parameter the loss does not depend on?), unexpected {extra}")
        return loss, grads

    def build(self) -> ExportedProgram:
        loss_inputs = self._joint_state()
        input_names = step_input_names(tuple(node.name for node in loss_inputs))
        loss, grads = self._gradients()
        model_state = list(self.state_specs)
        # New placeholders go before the user inputs (state) or at hparams' place among them.
        first_non_placeholder = next(node for node in self.graph.nodes if node.op != "placeholder")
        state_anchor = loss_inputs[0] if loss_inputs else first_non_placeholder
        self._new_state(STEP_STATE, state_anchor, torch.zeros((), dtype=torch.float32))
        for prefix in (EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX):
            for path in self.trainable:
                self._new_state(prefix + path, state_anchor,
                                torch.zeros_like(self.state_dict[MODEL_PREFIX + path], dtype=torch.float32))
        if self.grad_accum:
            self._new_grad_acc_state(state_anchor)
        position = input_names.index(HPARAMS)
        hparams_anchor = loss_inputs[position] if position < len(loss_inputs) else first_non_placeholder
        with self.graph.inserting_before(hparams_anchor):
            hparams = self.graph.placeholder(HPARAMS)
        hparams.meta["val"] = self._fake(lambda: torch.empty(len(HPARAM_NAMES), dtype=torch.float32))
        user_inputs = loss_inputs[:position] + [hparams] + loss_inputs[position:]

        output = self.graph.output_node()
        updates: dict[str, torch.fx.Node] = {}
        with self.graph.inserting_before(output):
            step = self._call(torch.ops.aten.add.Tensor, (self.node_of[STEP_STATE], 1.0))
            updates[STEP_STATE] = step
            for path in self.trainable:
                grad = grads[path]
                if self.grad_accum:  # the micro-batches' gradients so far, then none
                    grad = self._call(torch.ops.aten.add.Tensor, (grad, self.node_of[GRAD_ACC_PREFIX + path]))
                    updates[GRAD_ACC_PREFIX + path] = self._call(torch.ops.aten.zeros_like.default,
                                                                 (self.node_of[GRAD_ACC_PREFIX + path],))
                adamw = self._call(torch.ops.vktrain.adamw.default,
                                   (self.node_of[MODEL_PREFIX + path], self.node_of[EXP_AVG_PREFIX + path],
                                    self.node_of[EXP_AVG_SQ_PREFIX + path], grad, hparams, step))
                for i, prefix in enumerate((MODEL_PREFIX, EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX)):
                    updates[prefix + path] = self._call(operator.getitem, (adamw, i))
        mutated = [spec.target for spec in model_state if spec.target in updates] + \
            [STEP_STATE] + [prefix + path for prefix in (EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX) for path in self.trainable]
        if self.grad_accum:
            mutated += [GRAD_ACC_PREFIX + path for path in self.trainable]
        self.graph.erase_node(output)
        self.graph.output(tuple(updates[fqn] for fqn in mutated) + (loss,))
        self.graph.eliminate_dead_code()  # the gradient outputs' own nodes are kept: adamw reads them
        # (no recompile: ExportedProgram generates the code of a GraphModule of its own over this graph)
        return self._program(mutated, loss, user_inputs, input_names)

    def _new_grad_acc_state(self, anchor: torch.fx.Node) -> None:
        for path in self.trainable:
            self._new_state(GRAD_ACC_PREFIX + path, anchor,
                            torch.zeros_like(self.state_dict[MODEL_PREFIX + path], dtype=torch.float32))

    def build_accumulate(self) -> ExportedProgram:
        """The accumulate method: the loss's forward and backward, each gradient added into grad_acc.<path>;
        no optimizer state, no hparams; returns the loss."""
        loss_inputs = self._joint_state()
        loss, grads = self._gradients()
        anchor = loss_inputs[0] if loss_inputs else next(n for n in self.graph.nodes if n.op != "placeholder")
        self._new_grad_acc_state(anchor)
        output = self.graph.output_node()
        updates = {}
        with self.graph.inserting_before(output):
            for path in self.trainable:
                updates[GRAD_ACC_PREFIX + path] = self._call(
                    torch.ops.aten.add.Tensor, (self.node_of[GRAD_ACC_PREFIX + path], grads[path]))
        mutated = [GRAD_ACC_PREFIX + path for path in self.trainable]
        self.graph.erase_node(output)
        self.graph.output(tuple(updates[fqn] for fqn in mutated) + (loss,))
        self.graph.eliminate_dead_code()
        return self._program(mutated, loss, loss_inputs, tuple(node.name for node in loss_inputs))

    def _program(self, mutated: list[str], loss: torch.fx.Node, user_inputs: list[torch.fx.Node],
                 input_names: tuple[str, ...]) -> ExportedProgram:
        output_values = self.graph.output_node().args[0]
        output_specs = [OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(value.name), fqn)
                        for value, fqn in zip(output_values, mutated)]
        output_specs.append(OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(loss.name), None))
        input_specs = self.state_specs + [InputSpec(InputKind.USER_INPUT, TensorArgument(node.name), None)
                                          for node in user_inputs]
        call_graph = _root_call_graph(input_names, out_spec=pytree.tree_structure(0))  # returns the loss
        signature = _StepSignature(input_specs, output_specs)
        with signature.lookups_computed_once():
            return ExportedProgram(root=self.joint.graph_module, graph=self.graph, graph_signature=signature,
                                   state_dict=self.state_dict, range_constraints={}, module_call_graph=call_graph,
                                   example_inputs=None, constants=self.constants, verifiers=[self.joint.verifier])


class _StepSignature(ExportGraphSignature):
    """The step's signature; within `lookups_computed_once()` (the ExportedProgram constructor's validation)
    its buffer lookups are computed once instead of on every read.

    Why: torch's verifier reads `buffers_to_mutate` twice and `buffers` once per mutated buffer, and each read
    rebuilds them from every spec: quadratic in the state, 5 CPU-s for the 1,261 state tensors of a 30-layer
    step. Outside the context it is a plain ExportGraphSignature (whose specs later passes may change)."""

    _computed: dict | None = None

    @contextmanager
    def lookups_computed_once(self):
        self._computed = {}
        try:
            yield
        finally:
            self._computed = None

    def _once(self, name: str, compute):
        if self._computed is None:
            return compute()
        if name not in self._computed:
            self._computed[name] = compute()
        return self._computed[name]

    @property
    def buffers_to_mutate(self):
        return self._once("buffers_to_mutate", lambda: ExportGraphSignature.buffers_to_mutate.fget(self))

    @property
    def buffers(self):
        return self._once("buffers", lambda: ExportGraphSignature.buffers.fget(self))


def eval_program_from_joint(joint: ExportedProgram) -> ExportedProgram:
    """The loss alone (vktrain/export/eval.py's signature: the loss's inputs) from a copy of the joint
    graph: its forward part, every tensor it reads a constant under the joint graph's name (the trainable
    tensors as `model.<path>`, the training step's state names), no gradient. Leaves `joint` as it was."""
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.graph_copy(joint.graph, copies)
    loss, _ = _loss_and_gradients(joint)
    graph.output((copies[loss],))
    simplify_joint_graph(graph)
    placeholders = [copies[node] for node in joint.graph.nodes if node.op == "placeholder"]
    input_specs, state_dict, constants = [], {}, {}
    for node, spec in zip(placeholders, joint.graph_signature.input_specs):
        if spec.kind != InputKind.USER_INPUT and not node.users:
            graph.erase_node(node)  # read only by the backward
            continue
        input_specs.append(InputSpec(spec.kind, TensorArgument(node.name), spec.target, spec.persistent))
        if spec.kind == InputKind.PARAMETER:  # frozen: the eval method computes no gradient
            state_dict[spec.target] = torch.nn.Parameter(joint.state_dict[spec.target].detach(), requires_grad=False)
        elif spec.target in joint.state_dict:
            state_dict[spec.target] = joint.state_dict[spec.target].detach()
        elif spec.target is not None:
            constants[spec.target] = joint.constants[spec.target].detach()
    output = OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(graph.output_node().args[0][0].name), None)
    loss_inputs = tuple(spec.arg.name for spec in input_specs if spec.kind == InputKind.USER_INPUT)
    call_graph = _root_call_graph(loss_inputs, out_spec=pytree.tree_structure((0,)))  # returns (loss,)
    return ExportedProgram(root=torch.nn.Module(), graph=graph,
                           graph_signature=ExportGraphSignature(input_specs, [output]), state_dict=state_dict,
                           range_constraints={}, module_call_graph=call_graph, example_inputs=None,
                           constants=constants, verifiers=[joint.verifier])


def _root_call_graph(input_names: tuple[str, ...], out_spec) -> list[ModuleCallEntry]:
    """The module call graph of a program whose forward takes `input_names` positionally (no kwargs)."""
    in_spec = pytree.tree_structure((tuple(range(len(input_names))), {}))
    return [ModuleCallEntry("", ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec,
                                                    forward_arg_names=list(input_names)))]


def _loss_and_gradients(joint: ExportedProgram) -> tuple[torch.fx.Node, dict[str, torch.fx.Node]]:
    """The joint graph's loss output node, and its gradient output nodes by parameter path (no "model.")."""
    loss, grads = None, {}
    for value, spec in zip(joint.graph.output_node().args[0], joint.graph_signature.output_specs):
        if spec.kind == OutputKind.GRADIENT_TO_PARAMETER:
            grads[spec.target.removeprefix(MODEL_PREFIX)] = value
        elif spec.kind in (OutputKind.LOSS_OUTPUT, OutputKind.USER_OUTPUT) and loss is None:
            loss = value
    return loss, grads


def training_step_program(joint: ExportedProgram, trainable: list[str], grad_accum: bool = False) -> ExportedProgram:
    """The step program of a joint program whose gradient outputs are exactly the trainable tensors
    `trainable` (paths without the "model." prefix). Consumes `joint`: its graph module becomes the step's.
    `grad_accum`: the step adds grad_acc.<path> state to each gradient and zeroes it (accumulate_program)."""
    simplify_joint_graph(joint.graph_module.graph)
    return _StepBuilder(joint, trainable, grad_accum).build()


def accumulate_program(joint: ExportedProgram, trainable: list[str]) -> ExportedProgram:
    """The accumulate method of a `grad_accum` step: forward + backward, grad_acc.<path> += gradient, the
    loss returned. Built from a copy of `joint`, which it leaves as it was."""
    joint = copy.deepcopy(joint)
    simplify_joint_graph(joint.graph_module.graph)
    return _StepBuilder(joint, trainable).build_accumulate()
