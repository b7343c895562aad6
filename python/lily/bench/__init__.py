"""`lily bench`: throughput and numerical consistency under BENCHMARK.md's contract.

A sweep runs every (engine, length) arm in a fresh process (`python -m lily.bench.arm`),
alternating the engines' order, and writes results.json, results.md and results.png.
Modules, in the order data flows:

- contract: the rules shared by every engine (prompt formula, lengths, digests, drift);
- target: what model runs (synthetic config or a checkpoint) and its config for the roofline;
- runners: one Runner per engine (lily, and peers such as Hugging Face transformers);
- arm: one measured arm in its own process; memory: its peak memory;
- ceilings: copy bandwidth and matmul rate measured on the device; roofline: bytes and FLOPs;
- sweep: the driver with progress and the fail-closed checks; report and plot: the outputs;
- consistency and references: teacher-forced comparison with MLX-LM, transformers or lily's CPU.
"""
