"""``vitgraph serve --preset tiny --device cpu`` (Ray of its own) until it answers a request,
then a signal: what tests/test_serve.py's test_the_cli_serves_until_interrupted checks, as one
JSON object on stdout. Whatever happens, nothing the server started is left running (its
process group is killed). Run ahead of the test by tests/early_runs.py.

    python tests/serve_until_signal.py SIGINT|SIGTERM
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import torch
from safetensors.torch import load, save


def main(stop: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "vitgraph", "serve", "--preset", "tiny", "--device", "cpu",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    status, shape, poll = None, None, None
    try:
        try:
            body = save({"pixels": torch.randn(16, 1176, generator=torch.Generator().manual_seed(1)),
                         "grid_thw": torch.tensor([(1, 4, 4)])})
            request = urllib.request.Request(f"http://127.0.0.1:{port}/encode", data=body, method="POST",
                                             headers={"Content-Type": "application/octet-stream"})
            deadline = time.time() + 150
            while time.time() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(request, timeout=120) as response:
                        status, answer = response.status, response.read()
                    break
                except urllib.error.HTTPError as err:
                    status = err.code
                    if status != 404:  # 404: the proxy is up, the app not deployed yet
                        break
                except (urllib.error.URLError, ConnectionError):
                    pass
                time.sleep(0.25)
            poll = proc.poll()
            if status == 200:
                shape = list(load(answer)["embeddings"].shape)
        finally:
            proc.send_signal(getattr(signal, stop))
            out, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the server and any Ray process it left behind
        except ProcessLookupError:
            pass
        proc.wait()
    json.dump({"status": status, "poll": poll, "shape": shape, "returncode": proc.returncode, "out": out,
               "err": err}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
