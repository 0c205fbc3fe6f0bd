"""Writes the PyTorch tests' models into a model repository (run with Debian's python3, which has
torch and torchvision 1.13 / 0.14 from python3-torch and python3-torchvision):

  affine     INPUT__0 [4] FP32 -> OUTPUT__0 = x @ W + b [3] FP32, OUTPUT__1 = argmax [1] INT64
  ordered    forward(x, y) -> (x - y, x * y); the configuration lists INPUT__1 before INPUT__0 and
             OUTPUT__1 before OUTPUT__0
  inplace    forward() adds 1 to its input in place and returns twice it
  counter    forward() adds 1 to a buffer of its own and returns a view of it
  named_args forward(image, mask, scale=1.0) -> image - mask; the configuration lists mask first
  pair       inputs named a (FP32 [2]) and b (INT64 [2]), in forward()'s order; outputs named sum
             (a + b, FP32) and triple (3 * b, INT64), in the order forward() returns them
  raises     forward() raises for inputs with a negative first element
  resnet50   torchvision's ResNet-50 (random weights, seed 0), traced to TorchScript, and the same
             module exported to ONNX as resnet50_onnx; resnet50_input.npy / resnet50_expected.npy:
             a batch of 2 and what PyTorch itself computes for it
W, b for affine go to affine_W.npy and affine_b.npy beside the repository.
    python3 make_torch_models.py REPO [--resnet]"""
import os
import sys

import numpy as np
import torch

repo = sys.argv[1]
os.makedirs(repo, exist_ok=True)
torch.manual_seed(0)


def write(name, module, config, example=None, trace=False):
    os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
    m = torch.jit.trace(module, example) if trace else torch.jit.script(module)
    m.save(os.path.join(repo, name, "1", "model.pt"))
    with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
        f.write(config)


class Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 3))
        self.b = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        y = x @ self.w + self.b
        return y, torch.argmax(y, dim=1, keepdim=True)


affine = Affine()
np.save(os.path.join(repo, "..", "affine_W.npy"), affine.w.detach().numpy())
np.save(os.path.join(repo, "..", "affine_b.npy"), affine.b.detach().numpy())
write("affine", affine, '''platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] },
         { name: "OUTPUT__1" data_type: TYPE_INT64 dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
instance_group [ { count: 1 } ]
''')


class Ordered(torch.nn.Module):
    def forward(self, x, y):
        return x - y, x * y


write("ordered", Ordered(), '''backend: "pytorch"
max_batch_size: 4
input [ { name: "INPUT__1" data_type: TYPE_FP32 dims: [ 2 ] },
        { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 2 ] },
         { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
''')


class Pair(torch.nn.Module):
    def forward(self, a, b):
        return (a + b.to(torch.float32), b * 3)


write("pair", Pair(), '''platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "a" data_type: TYPE_FP32 dims: [ 2 ] },
        { name: "b" data_type: TYPE_INT64 dims: [ 2 ] } ]
output [ { name: "sum" data_type: TYPE_FP32 dims: [ 2 ] },
         { name: "triple" data_type: TYPE_INT64 dims: [ 2 ] } ]
''')


class Raises(torch.nn.Module):
    def forward(self, x):
        if bool(x[0, 0] < 0):
            raise RuntimeError("negative input refused")
        return x


write("raises", Raises(), '''platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
''')



class InPlace(torch.nn.Module):
    def forward(self, x):
        x.add_(1)  # writes into its input
        return x * 2


write("inplace", InPlace(), '''platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
''')


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(8, 2))

    def forward(self, x):
        self.count.add_(1)
        return self.count[: x.shape[0]]  # a view of the module's own buffer


write("counter", Counter(), '''platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
instance_group [ { count: 1 } ]
''')


class NamedArgs(torch.nn.Module):
    def forward(self, image, mask, scale: float = 1.0):
        return (image - mask) * scale


write("named_args", NamedArgs(), '''platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "mask" data_type: TYPE_FP32 dims: [ 2 ] },
        { name: "image" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "diff" data_type: TYPE_FP32 dims: [ 2 ] } ]
''')

if "--resnet" in sys.argv:
    import torchvision

    net = torchvision.models.resnet50(weights=None).eval()
    example = torch.rand(1, 3, 224, 224)
    with torch.no_grad():
        write("resnet50", net, '''platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1000 ] } ]
''', example, trace=True)
        os.makedirs(os.path.join(repo, "resnet50_onnx", "1"), exist_ok=True)
        torch.onnx.export(net, example, os.path.join(repo, "resnet50_onnx", "1", "model.onnx"),
                          input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=13)
        # ONNX Runtime's FP32 arithmetic, the reference's (unconfigured, the runtime measured fastest
        # would serve it, OpenVINO bf16 on a CPU with AVX512_BF16).
        with open(os.path.join(repo, "resnet50_onnx", "config.pbtxt"), "w") as f:
            f.write('backend: "onnxruntime"\nmax_batch_size: 4\n')
        x = torch.rand(2, 3, 224, 224)
        np.save(os.path.join(repo, "..", "resnet50_input.npy"), x.numpy())
        np.save(os.path.join(repo, "..", "resnet50_expected.npy"), net(x).numpy())
