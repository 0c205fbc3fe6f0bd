"""Precision and recall of a detector on the labelled photographs of tests/data/labels/detection.json
(boxed by a person reading each photo). A detection is right when it names a labelled object of the
photo (its label or one of its 'also' names) with IoU >= 0.5 and that object was not found already;
one lying mostly (half its area or more) inside an 'ignore' region of its label (or of any label,
when the region names none) counts neither way; every other detection is a false positive.

    from detection_labels import LABELS, PHOTOS, score
    result = score({photo: [(label, confidence, [x0, y0, x1, y1]), ...]}, threshold=0.5)
"""
import json
import os

HERE = os.path.dirname(__file__)
LABELS = json.load(open(os.path.join(HERE, "..", "data", "labels", "detection.json")))["photos"]
PHOTOS = os.path.join(HERE, "..", "..", "third_party", "real-models", "photos")


def iou(a, b):
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def inside(a, region):
    """The share of box a's area inside region."""
    ix = max(0.0, min(a[2], region[2]) - max(a[0], region[0]))
    iy = max(0.0, min(a[3], region[3]) - max(a[1], region[1]))
    area = (a[2] - a[0]) * (a[3] - a[1])
    return ix * iy / area if area > 0 else 0.0


def score(detections, threshold):
    """detections: {photo: [(label, confidence, box)]}. Returns a dict: tp, fp, objects, precision,
    recall, and 'false' (photo, label, confidence) and 'missed' (photo, label) lists."""
    tp, fp, objects, false, missed = 0, 0, 0, [], []
    for photo, truth in LABELS.items():
        found = [False] * len(truth["objects"])
        objects += len(truth["objects"])
        for label, conf, box in sorted(detections.get(photo, []), key=lambda d: -d[1]):
            if conf < threshold:
                continue
            best, best_iou = -1, 0.5
            for k, o in enumerate(truth["objects"]):
                names = [o["label"]] + o.get("also", [])
                if not found[k] and label in names and iou(box, o["box"]) >= best_iou:
                    best, best_iou = k, iou(box, o["box"])
            if best >= 0:
                found[best] = True
                tp += 1
            elif any(inside(box, r["box"]) >= 0.5 and r.get("label", label) == label for r in truth["ignore"]):
                continue
            else:
                fp += 1
                false.append((photo, label, round(conf, 2)))
        missed += [(photo, o["label"]) for k, o in enumerate(truth["objects"]) if not found[k]]
    return {"tp": tp, "fp": fp, "objects": objects, "precision": tp / (tp + fp) if tp + fp else 1.0,
            "recall": tp / objects if objects else 1.0, "false": false, "missed": missed}
