"""Top-5 ImageNet classes from logits, in Triton's Python backend API."""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.k = int(pb_utils.get_output_config_by_name(config, "classes")["dims"][0])
        labels = os.path.join(args["model_repository"], "..", "imagenet", "labels.txt")
        try:
            with open(labels, encoding="utf-8") as f:
                self.labels = [line.strip() for line in f]
        except OSError:
            pb_utils.Logger.log_warn(f"no {labels}: classes are named by number")
            self.labels = []

    def execute(self, requests):
        # One matrix for the whole batch, then one response per request.
        logits = [pb_utils.get_input_tensor_by_name(r, "logits").as_numpy() for r in requests]
        x = np.concatenate(logits).astype(np.float64)
        p = np.exp(x - x.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        top = np.argsort(-p, axis=1, kind="stable")[:, : self.k]
        responses, row = [], 0
        for part in logits:
            n = part.shape[0]
            classes = top[row:row + n]
            probabilities = np.take_along_axis(p[row:row + n], classes, axis=1)
            names = np.array([[self._name(c) for c in line] for line in classes], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("classes", classes.astype(np.int32)),
                pb_utils.Tensor("probabilities", probabilities.astype(np.float32)),
                pb_utils.Tensor("labels", names),
            ]))
            row += n
        return responses

    def _name(self, c):
        return (self.labels[c] if c < len(self.labels) else f"class {c}").encode()
