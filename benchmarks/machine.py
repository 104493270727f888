"""The machine a benchmark ran on, for its JSON: the CPU model, cores, Python, kernel, and the load when it started
(other work on the machine skews the numbers)."""
import os
import platform


def machine() -> dict:
    with open("/proc/cpuinfo") as f:
        models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return {"cpu": models[0] if models else platform.processor(), "cores": os.cpu_count(),
            "python": platform.python_version(), "kernel": platform.release(),
            "load_average_1min_at_start": round(os.getloadavg()[0], 2)}
