#!/usr/bin/env python3
"""The Python side of a BLS call without its I/O: pb_utils.InferenceRequest(...).exec() through the
stub's own encoding and decoding (src/backends/python/stub.py run here with its socket functions
replaced: the frame sent is dropped, the answer is a frame naming one 16-byte UINT8 output in the
BLS shared memory). Prints the thread CPU per call; bench/python_bench measures the whole call.

    build/venv/bin/python bench/bls_encode.py [--calls 20000] [--stub OTHER_STUB.py]
"""
import argparse
import os
import struct
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--stub", default=os.path.join(ROOT, "src", "backends", "python", "stub.py"),
                    help="the stub to measure (another version of it, to compare)")
    args = ap.parse_args()
    import numpy as np
    src = open(args.stub).read()
    stub = {"__name__": "bls_encode"}
    exec(compile(src[:src.rindex("_main()")], "stub.py", "exec"), stub)  # its functions, not its main loop
    fd = os.memfd_create("bls")
    os.ftruncate(fd, 1 << 20)
    os.dup2(fd, stub["BLS_FD"])
    utils = types.ModuleType("triton_python_backend_utils")
    utils_file = os.path.join(ROOT, "src", "backends", "python", "triton_python_backend_utils.py")
    exec(compile(open(utils_file).read(), utils_file, "exec"), utils.__dict__)
    utils._bls_call = lambda request, decoupled=False: stub["_bls_call"](request, np, utils, decoupled)
    stub["_bls_state"]["open"] = True
    stub["_send"] = lambda payload: None
    out = struct.pack("<H", 1) + struct.pack("<HBB", 1, 2, 2) + b"y" + struct.pack("<2q", 1, 16) + struct.pack("<QQ", 16, 0)
    stub["_next_frame"] = lambda: b"b" + struct.pack("<IQBBI", stub["_bls_state"]["next"], 1 << 20, 0, 0, 0) + out
    x = utils.Tensor("x", np.arange(16, dtype=np.uint8).reshape(1, 16))

    def call():
        answer = utils.InferenceRequest(model_name="nothing", inputs=[x], requested_output_names=["y"]).exec()
        if answer.has_error():
            sys.exit(answer.error().message())

    for _ in range(100):
        call()
    start = time.thread_time()
    for _ in range(args.calls):
        call()
    print(f"Python CPU per BLS call, without I/O: {(time.thread_time() - start) / args.calls * 1e6:.1f} us")


if __name__ == "__main__":
    main()
