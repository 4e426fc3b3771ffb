"""MODEL_CARD.md: a release's metrics.json and config, written for people."""
from __future__ import annotations


def model_card(metrics: dict, config: dict) -> str:
    per_class = "\n".join(f"| {label} | {100 * acc:.1f}% |" for label, acc in metrics["test_acc_per_class"].items())
    speed = "\n".join(f"| {r['backend']} | {r['batch_size']} | {r['images_per_s']:,.0f} | {r['ms_per_batch']:.2f} |"
                      for r in metrics["inference"]["throughput"])
    train = metrics["training"]
    spread = ""
    if metrics["speedrun"]:
        s = metrics["speedrun"]
        spread = (f"\nOver {s['n']} seeds of the same recipe ({s['evaluation']}): mean {100 * s['mean']:.2f}%"
                  + (f", std {100 * s['std']:.2f}" if s["std"] is not None else "") + ".\n")
    machine = metrics["inference"]["measured_on"]
    return f"""# CIFAR-10 classifier, release {metrics['release']}

Written by `cifarkit release` on {metrics['created']}; every number here comes from `metrics.json`.

## Model
- Architecture `{metrics['model']}`: {metrics['params']:,} parameters, {metrics['macs']:,} MACs per image.
- Input: RGB 32 x 32, normalized with mean {config['data']['mean']} and std {config['data']['std']}
  (`preprocess.py` does it for any image, with numpy and Pillow only).
- Output: 10 logits for {', '.join(config['model']['classes'])}.
- Weights stored as {metrics['weights_dtype']} ({metrics['weights_bytes'] / 1e6:.1f} MB),
  sha256 `{metrics['weights_sha256']}`.

## Training
Recipe `{metrics['recipe']}`, seed {train['seed']}, {train['epochs']} epochs on {_device(train)}
({train['precision']}): wall time {train['wall_time_s'] / 60:.1f} min, what one run costs to reproduce there.
{_teacher(config['training'])}Data: {_training_data(train, config['data'])} of the CIFAR-10 training set (content sha256
`{metrics['dataset_sha256']}`). The test set was never used to choose anything.

## Evaluation
Test accuracy {100 * metrics['test_acc']:.2f}% on the {metrics['test_images']:,} CIFAR-10 test images
({metrics['test_acc_evaluation']}); {100 * metrics['test_acc_tta']:.2f}% with mirror + 1-pixel-shift TTA.
{spread}
| class | accuracy |
|---|---:|
{per_class}

## Inference speed
On {machine['processor']} ({machine['threads']} threads), torch {metrics['torch']}; {metrics['inference']['what']}.
Default backend on this machine: `{metrics['inference']['default_backend']}`
({metrics['inference']['default_backend_reason']}).
Every machine decides `auto` for itself: bf16 only where the CPU computes it natively, and only a backend whose test
accuracy is within 0.1 points of fp32's and whose predictions agree with fp32's on at least 99.5% of the test images.

| backend | batch | img/s | ms per batch |
|---|---:|---:|---:|
{speed}

## Use
```python
from cifarkit import Classifier
clf = Classifier.load("version_{metrics['release']}")   # or Classifier.pretrained() for the shipped default
clf.predict("image.png")          # class index
clf.topk("image.png", k=3)        # [(label, probability), ...]
```

## Limits
Trained on 32 x 32 CIFAR-10 photos of ten classes: any other image is squeezed to 32 x 32 and forced into one of
these classes. Accuracy on images unlike CIFAR-10 (drawings, close-ups, other classes) is not measured here.
"""


def _training_data(train: dict, data_config: dict) -> str:
    """'48,000 images (a class-balanced subset; 2,000 more held out for validation)' and the like."""
    how = ["a class-balanced subset"] if data_config["subset"] else []
    if data_config["val_split"]:
        how.append(f"{data_config['val_split']:,} more held out for validation")
    return f"{train['train_images']:,} images" + (f" ({'; '.join(how)})" if how else "")


def _device(train: dict) -> str:
    """'2 threads of an amx CPU', where the release recorded them; else the device's name."""
    if "cpu_kind" in train:
        return f"{train['threads']} threads of an {train['cpu_kind']} CPU"
    return train["device"]


def _teacher(training: dict) -> str:
    """The distillation sentence of a run that had a teacher, else nothing."""
    teacher = training["run"].get("teacher")
    if not teacher:
        return ""
    distill = training["distill"]
    targets = ("its TTA logits of each training image, computed once before training"
               if distill.get("targets") == "tta" else "its logits on each augmented batch")
    return (f"Distilled from the release at `{teacher['release']}` (`{teacher['model']}`): loss "
            f"{1 - distill['weight']:g} x cross-entropy + {distill['weight']:g} x the KL divergence from the "
            f"teacher's soft targets ({targets}) at temperature {distill['temperature']:g}.\n")
