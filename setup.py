"""megarl: RL post-training for LLMs on Megatron-Core, with SGLang rollouts.

Install with `bash launchers/install.sh` (it installs the pinned stack into .venv; see README). The pins below are
the versions that are tested; the CPU and GPU sets are extras because their torch builds differ.
"""
from setuptools import find_packages, setup

MEGATRON_CORE = "megatron-core==0.19.2"  # also checked at run time on CPU, where the shims apply (platform/version.py)
SGLANG = "sglang==0.5.23"
MBRIDGE = "mbridge==0.15.1"

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-Core RL post-training (GRPO/PPO family) with an SGLang rollout engine",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl", "megarl.*"]),
    # What megarl's default paths import. Lower bounds only: the exact, tested versions are pinned in requirements/
    # (cpu.txt, gpu.txt), which launchers/install.sh installs.
    install_requires=[
        "transformers>=5.19",
        "tokenizers>=0.23",
        "safetensors>=0.8",
        "numpy>=2.0",
        "pyyaml>=6.0",
        "psutil>=7.0",
        "packaging>=24.2",
        "requests>=2.32",  # SGLang HTTP client
        "tqdm>=4.66",  # progress bar
        "wandb>=0.31",  # logging.wandb (offline by default)
        "math-verify>=0.9",  # reward.name=math
        "matplotlib>=3.10",  # megarl report, pass@k plots
        "pyarrow>=20",  # Parquet data files
    ],
    extras_require={
        # megatron-core, mbridge and (on CPU) SGLang are installed with --no-deps by launchers/install.sh,
        # because their declared dependencies pin CUDA-only packages; they are listed here for the record.
        "cpu": ["torch==2.13.0", MEGATRON_CORE, MBRIDGE, SGLANG, "triton==3.9.0", "pytest==9.2.0"],
        "gpu": ["torch==2.14.1", MEGATRON_CORE, MBRIDGE, SGLANG, "transformer-engine[pytorch]==2.20.2"],
        # the SmolLM2 example (megarl convert-gguf): transformers' GGUF loader
        "examples": ["gguf>=0.19", "accelerate>=1.16"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main",
                                      "megarl-torchrun=megarl.launch.torchrun:main"]},
)
