"""The training application on top of the runtime (torch-free): the loop, LR schedule, token data,
atomic checkpoints, PEFT adapters and the loss plot. `vktrain train` is wired from here."""
