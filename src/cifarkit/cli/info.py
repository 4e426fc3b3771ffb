"""`cifarkit env`, `models` and `recipes`: what this machine, the registry and the recipes offer."""
from __future__ import annotations

from cifarkit.cli.common import DEFAULT_RECIPE, command, print_json


def cmd_env(args) -> None:
    from cifarkit.core.device import describe, pick_device, report
    info = report(pick_device("auto"))
    if args.json:
        print_json(info)
    else:
        print("\n".join(describe(info)))


def cmd_models(args) -> None:
    from cifarkit import models
    rows = []
    for name in models.names():
        model = models.create(name)
        rows.append({"name": name, "params": models.count_params(model), "macs": models.count_macs(model)})
    if args.json:
        print_json(rows)
        return
    print(f"{'model':<12} {'params':>12} {'MACs/image':>14}")
    for r in rows:
        print(f"{r['name']:<12} {r['params']:>12,} {r['macs']:>14,}")


def cmd_recipes(args) -> None:
    import yaml

    from cifarkit.training.config import builtin_recipes, explain, load_recipe
    if args.recipe is None:
        for name in sorted(builtin_recipes()):
            default = " (default)" if name == DEFAULT_RECIPE else ""
            print(f"{name:<16} {load_recipe(name).description}{default}")
        return
    recipe, header, rows = explain(args.recipe)
    print(f"{recipe.name}{' (default)' if recipe.name == DEFAULT_RECIPE else ''}: {recipe.description}")
    for line in header:
        print(f"# {line}")
    for key, value, reason in rows:
        # YAML's spelling (null, true, [0.5, 0.5, 0.5]): what --set and a recipe file take.
        shown = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True,
                               width=1_000).strip().removesuffix("\n...")
        note = "default" if reason is None else reason
        print(f"{key} = {shown}" + (f"  # {note}" if note else ""))


def register(sub) -> None:
    """Adds this group's commands to the `cifarkit` parser's subcommands."""
    p = command(sub, "env", "report the device, CUDA/cuDNN, bf16 support and threads")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_env)
    p = command(sub, "models", "list the registered models with parameters and MACs")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_models)
    p = command(sub, "recipes", "list the built-in recipes, or show one recipe's values and the reason for each")
    p.add_argument("recipe", nargs="?", metavar="RECIPE", help="a built-in recipe name or a YAML path")
    p.set_defaults(func=cmd_recipes)
