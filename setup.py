"""ds4sci: Evoformer attention kernels and long-context genome language models.

Packages are listed explicitly. ``kernels/`` and ``models/`` are installed as ``ds4sci.kernels`` and
``ds4sci.models`` (never as top-level ``kernels``/``models``: PyPI already has packages by those names).
"""
from setuptools import setup

PACKAGES = {
    "ds4sci": "ds4sci",
    "ds4sci.distributed": "ds4sci/distributed",
    "ds4sci.sequence": "ds4sci/sequence",
    "ds4sci.parallel": "ds4sci/parallel",
    "ds4sci.parallel.evoformer": "ds4sci/parallel/evoformer",
    "ds4sci.data": "ds4sci/data",
    "ds4sci.train": "ds4sci/train",
    "ds4sci.infer": "ds4sci/infer",
    "ds4sci.io": "ds4sci/io",
    "ds4sci.planning": "ds4sci/planning",
    "ds4sci.commands": "ds4sci/commands",
    "ds4sci.integrations": "ds4sci/integrations",
    "ds4sci.bench": "ds4sci/bench",
    "ds4sci.bench.aot": "ds4sci/bench/aot",
    "ds4sci.kernels": "kernels",
    "ds4sci.models": "models",
    "ds4sci.models.genslm": "models/genslm",
    "ds4sci.models.evoformer": "models/evoformer",
}

setup(
    name="ds4sci",
    version="0.1.0",
    description="Evoformer attention kernels in Triton and long-context genome LMs with sequence parallelism",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    install_requires=[
        # A range the CPU wheel torch==2.13.0 satisfies; the Makefile installs that wheel first.
        "torch>=2.4,<2.15",
        "triton>=3.2",
        # The range the equivalence tests pass with: the loss scale undoes how DeepSpeed reduces gradients per ZeRO
        # stage (ds4sci.train.loss.grad_reduction_factor), a behaviour of the release, checked at start-up
        # (ds4sci.train.sanity); widen it only after tests/distributed/test_train_equivalence.py passes.
        "deepspeed>=0.19.8,<0.20",
        "biopython>=1.80",
        "pysam>=0.22",  # VCF reading (ds4sci score-variants)
        "numpy>=1.24",
        "pyyaml>=6.0",
        "safetensors>=0.4",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "tensorboard>=2.14",
        # task metrics and the linear probe (ds4sci.data.metrics, ds4sci probe); 1.9: LogisticRegressionCV's
        # l1_ratios / use_legacy_attributes, the arguments that keep working past 1.10's change of defaults
        "scikit-learn>=1.9,<2",
        "peft>=0.17",  # LoRA for fine-tuning (ds4sci.train.lora): inject_adapter_in_model, its state dict helpers
        "pyarrow>=14",  # embed --out X.parquet: embeddings streamed in shards (ds4sci.infer.shards)
    ],
    extras_require={
        # ds4sci.integrations.openfold replaces a private function of openfold3 0.5 (_deepspeed_evo_attn)
        "openfold": ["openfold3>=0.5,<0.6"],
        "gpu": ["flash-attn"],
        "dev": ["pytest>=7.4", "pytest-timeout>=2.2", "pytest-xdist>=3.8", "hypothesis>=6.80", "transformers>=4.40",
                # pandas: the Parquet read-back test reads embed's output as a user does
                "pandas>=2.0",
                # ruff: `make lint` (its rules change between minor releases); mutmut: `make mutate`
                "ruff>=0.17,<0.18", "mutmut>=3.8,<4",
                # mpiexec (MPICH) and mpi4py: the `mpiexec -n 2 ds4sci train` test (tests/distributed/test_launchers.py)
                "mpich>=4.2", "mpi4py>=4.0",
                # Prodigal's gene calls: examples/tasks/make_coding_task.py, which derives the bundled coding task
                "pyrodigal>=3.7",
                # the documentation site: `make docs` (mkdocs build --strict), tests/test_docs.py
                "mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "mkdocstrings-python>=1.10"],
    },
    entry_points={"console_scripts": ["ds4sci=ds4sci.cli:main"]},
)
