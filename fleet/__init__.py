"""Code that runs inside the serving fleet's own processes: loaded by `vllm serve` from its environment, by
import path (`--middleware draftsmith.fleet.middleware.TrafficLog`, `kv_connector_module_path:
draftsmith.fleet.vllm_capture`, and for promotion in place `--worker-extension-cls
draftsmith.fleet.drafter_swap.DrafterSwap` with `--middleware draftsmith.fleet.drafter_route.DrafterRoute`).

The engine's environment pins its own torch and transformers and has none of draftsmith's dependencies, so
these modules import the standard library, torch, safetensors and vllm only — never another draftsmith
module (scripts/check_imports.py holds them to it). In the fleet: `pip install --no-deps draftsmith` into
the engine's environment; draftsmith's own tests put the package on the engine's path instead
(data/engines/vllm_server.vllm_env). What they write (traffic logs, hidden-state captures) is read back on
draftsmith's side by one validating reader each (planning/production.py with planning/logs.py;
data/served.py), and capture_file.py is the capture format both sides import.
"""
