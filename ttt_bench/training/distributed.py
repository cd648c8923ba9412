"""Multi-process strategies as the trainer configs build them (conf/trainer/ddp.yaml, fsdp.yaml, slurm.yaml).

DDP runs on CPU processes (gloo) as on GPUs (NCCL): `trainer=ddp trainer.accelerator=cpu trainer.devices=2`
trains the model one process would with the same global batch (tests/test_scaleout.py). FSDP does not run
on CPU processes with the Lightning and torch of this project; `fsdp_strategy` says so in one line instead of
failing inside Lightning."""

from ..errors import UserError

FSDP_ON_CPU = (
    "trainer=fsdp runs on CUDA GPUs only: Lightning's FSDPStrategy refuses CPU accelerators, wraps the model "
    "with no device (torch FSDP then stops with 'FSDP needs a non-CPU accelerator device') and gathers full "
    "state dicts with offload_to_cpu=True, which fails on CPU tensors; for several CPU processes use "
    "trainer=ddp trainer.accelerator=cpu"
)


def fsdp_strategy(accelerator: str = "gpu", **kwargs):
    """Lightning's FSDPStrategy(**kwargs) for a GPU trainer; a UserError (FSDP_ON_CPU) for CPU processes."""
    import torch
    from lightning.pytorch.strategies import FSDPStrategy

    if str(accelerator) == "cpu" or (str(accelerator) == "auto" and not torch.cuda.is_available()):
        raise UserError(FSDP_ON_CPU)
    return FSDPStrategy(**kwargs)
