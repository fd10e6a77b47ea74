"""CUDA MPS: start the backend's own daemon (own pipe and log folders) and stop it at exit.

Clients find the daemon through CUDA_MPS_PIPE_DIRECTORY in their environment at CUDA init, so the
daemon must be up before the engine and trainer processes start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time


class MPSError(RuntimeError):
    """The MPS daemon could not be started or stopped."""


class MPSDaemon:
    def __init__(self, root: str | None = None):
        self.root = tempfile.mkdtemp(prefix="nodus-mps-", dir=root)
        self.pipe_dir = os.path.join(self.root, "pipe")
        self.log_dir = os.path.join(self.root, "log")
        os.makedirs(self.pipe_dir)
        os.makedirs(self.log_dir)
        self.running = False

    @property
    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def start(self) -> "MPSDaemon":
        exe = shutil.which("nvidia-cuda-mps-control")
        if exe is None:
            raise MPSError("--sharing mps needs nvidia-cuda-mps-control on PATH (CUDA's MPS binaries)")
        r = subprocess.run([exe, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True)
        if r.returncode != 0:
            raise MPSError(f"nvidia-cuda-mps-control -d failed ({r.returncode}): {r.stderr.strip()}")
        time.sleep(0.5)
        self.running = True
        return self

    def stop(self) -> None:
        if not self.running:
            return
        exe = shutil.which("nvidia-cuda-mps-control")
        subprocess.run([exe], input="quit\n", env={**os.environ, **self.env}, capture_output=True, text=True)
        self.running = False
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "MPSDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
