"""The machine a number was measured on, in one line (results files, run metrics, step.json)."""

import os
import platform

import torch


def hardware() -> str:
    """CPU, cores, torch and its threads, GPU."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, {gpu}"
    )
