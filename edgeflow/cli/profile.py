"""``edgeflow profile list|show|detect``: the boards edgeflow knows."""

from __future__ import annotations

ORDER = 10


def register(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="list, show or detect device profiles",
        description="Device profiles describe boards as data (device_profiles/*.toml): arch, cores, "
        "memory budget, execution providers, backends, quantization scheme, threads, training.",
    )
    ps = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = ps.add_parser("list", help="every built-in profile")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)
    sh = ps.add_parser("show", help="one profile in full")
    sh.add_argument("name", help="profile name (see 'edgeflow profile list') or path to a .toml file")
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(func=cmd_show)
    de = ps.add_parser("detect", help="the built-in profile closest to this machine")
    de.add_argument("--json", action="store_true")
    de.set_defaults(func=cmd_detect)


def cmd_list(args) -> int:
    from ..profiles import builtin_profiles
    from ._common import console, emit_json, fit_table

    profs = builtin_profiles()
    if args.json:
        emit_json([p.to_dict() for p in profs.values()])
        return 0
    cols = [("name", 0, "left"), ("arch", 0, "left"), ("cores", 2, "right"), ("budget MiB", 1, "right"),
            ("backends", 0, "left"), ("quantization", 3, "left"), ("trains", 1, "left")]
    rows = [[p.name, p.arch, str(p.cores), str(p.memory_budget_mb), " > ".join(p.backends),
             f"{p.quantization.scheme}/{p.quantization.activations}", "yes" if p.can_train else "no"]
            for p in profs.values()]
    c = console()
    t = fit_table("device profiles", cols, rows, c.width)
    c.print(t)
    return 0


def _show(p, as_json: bool) -> int:
    from ._common import console, emit_json

    if as_json:
        emit_json(p.to_dict())
        return 0
    c = console()
    c.print(f"[bold]{p.name}[/bold]: {p.description}")
    for k, v in p.to_dict().items():
        if k not in ("name", "description"):
            c.print(f"  {k}: {v}")
    return 0


def cmd_show(args) -> int:
    from ..profiles import get_profile

    return _show(get_profile(args.name), args.json)


def cmd_detect(args) -> int:
    from ..profiles import detect

    return _show(detect(), args.json)
