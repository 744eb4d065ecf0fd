"""Command line: ``gpupool replay [TRACE]`` replays a Mooncake-format trace; ``gpupool bench`` benchmarks.

Examples::

    gpupool replay                                  # bundled trace; see "what runs" below
    gpupool replay --pool reference                 # CPU reference pool, whole trace (a few seconds)
    gpupool replay --pool both --json out.json      # both pools on the same requests; exit 1 unless equal
    gpupool replay my.jsonl --lenient --json -      # a trace of your own; the JSON report on stdout
    gpupool bench --quick                           # benchmarks (bench/), JSON + PNG under bench/out/

What runs by default (``--pool auto``): on a CUDA machine the whole trace on the device pool, checked
against the reference pool, with the speed ratio. Without a GPU the device pool's kernels run in
Triton's interpreter on the CPU (correct but about a thousand times slower), so the whole trace runs
on the reference pool (the result) and the device pool replays the first ``--device-limit`` requests
(default 200), checked against the reference pool on the same requests; no speed is compared.

The model is docs/semantics.md section 5; the errors docs/errors.md. Every failure of the command is
one line ``gpupool: error: ...`` with exit status 2; 1 means the device pool and the reference pool
disagreed (a bug) or benchmarks failed.
"""
# ``gpupool.cli.main`` is the function (the console script ``gpupool.cli:main``); its module is reached
# with ``from gpupool.cli.main import ...``.
from .main import build_parser, main
from .types import CLIError, CLISubcommand

__all__ = ["CLIError", "CLISubcommand", "build_parser", "main"]
