"""The torch-free contract (vktrain/contract.py): one hparams layout and one set of AdamW defaults,
shared by the op library, the exporter, the runtime and the train loop."""
from __future__ import annotations

import argparse
import inspect

import numpy as np
import torch

from vktrain import contract


def test_adamw_defaults_are_torch_optim_adamw_s():
    signature = inspect.signature(torch.optim.AdamW.__init__).parameters
    beta1, beta2 = signature["betas"].default
    assert contract.ADAMW_DEFAULTS == {"beta1": beta1, "beta2": beta2, "eps": signature["eps"].default,
                                       "weight_decay": signature["weight_decay"].default}


def test_every_hparams_builder_uses_the_contract_defaults():
    """The op library, the train loop's optimizer config and its CLI flags agree (the train loop used to
    default weight decay to 0.0 while the op library defaulted to 1e-2)."""
    from vktrain.ops import adamw_hparams
    from vktrain.train.command import add_train_arguments, hyperparameter
    from vktrain.train.train_loop import AdamWConfig

    expected = np.array(contract.hparams_values(3e-4), np.float32)
    assert len(expected) == len(contract.HPARAM_NAMES)
    np.testing.assert_array_equal(adamw_hparams(3e-4).numpy(), expected)
    np.testing.assert_array_equal(AdamWConfig().hparams(3e-4), expected)
    args = add_train_arguments(argparse.ArgumentParser()).parse_args(["program.pte", "--steps", "1"])
    flags = AdamWConfig(*(hyperparameter(args, name) for name in ("beta1", "beta2", "eps", "weight_decay")))
    np.testing.assert_array_equal(flags.hparams(3e-4), expected)


def test_the_exporter_and_runtime_read_the_contract_names():
    from vktrain.export import step_graph, training
    from vktrain.runtime.program import runner
    from vktrain.train import checkpoint

    assert step_graph.HPARAM_NAMES is contract.HPARAM_NAMES
    assert step_graph.STEP_INPUTS is contract.STEP_INPUTS and step_graph._JOINT_USER_INPUTS is contract.EVAL_INPUTS
    assert training.STEP_BUFFER == step_graph.STEP_STATE == checkpoint.OPTIMIZER_STEP_STATE == contract.STEP_STATE
    assert runner.STEP_INPUTS is contract.STEP_INPUTS
    assert [p for p in contract.STATE_PREFIXES if contract.EXP_AVG_PREFIX.startswith(p)] == ["optimizer."]
