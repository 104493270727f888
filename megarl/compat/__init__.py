"""Where megarl depends on the internals of the libraries it builds on: one module per library.

    megarl.compat.megatron   megatron-core 0.19.2: the CPU shims (monkeypatches), megatron's global process groups
                             (parallel_state: created, destroyed and read only here and in the user adapter
                             megarl.parallel.user_groups), the optimizer's groups, RankGenerator, MLA on CPU
    megarl.compat.mbridge    mbridge 0.15.1: its private model registry, name tables and per-tensor rules, and the
                             attributes megarl sets on its bridges and on HF configs for it
    megarl.compat.sglang     SGLang 0.5.23: the import-time patches and stand-in packages put on the CPU SGLang
                             server's PYTHONPATH (sglang_cpu/), and the SGLang internals megarl's trainer imports
    megarl.compat.torch      torch 2.13.0: a worker torchrun restarted gets its own keys on the agent's store (the
                             static rendezvous keeps the previous attempt's gloo addresses there)

Every private member (`_name`) of those libraries that megarl uses, and every monkeypatch of them, lives in one of these
modules, with a docstring naming the library version it was written for and the upstream code it relies on or works
around. Each module has a VERSION and a `check_assumptions()` returning the assumptions that no longer hold;
tests/compat/test_compat.py calls them, so an upgrade that breaks one fails a named test. Importing this package imports none
of the libraries.
"""
