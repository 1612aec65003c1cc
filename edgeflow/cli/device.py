"""``edgeflow device``: run this board's fleet agent until stopped."""

from __future__ import annotations

ORDER = 60


def register(sub) -> None:
    p = sub.add_parser(
        "device",
        help="run the fleet agent on this board",
        description="Join the fleet with the credentials from `edgeflow fleet provision`: announce this board "
        "(birth/death), send telemetry, serve inference on the deployed model (MQTT infer topic), obey signed "
        "commands and install signed OTA models with rollback. Runs until SIGINT/SIGTERM.",
    )
    p.add_argument("--profile", help="device profile name or .toml path (default: from the credentials)")
    p.add_argument("--broker", help="broker URL, e.g. mqtts://gateway.local:8883 (default: from the credentials)")
    p.add_argument("--credentials", required=True, help="credentials directory (from `edgeflow fleet provision`)")
    p.add_argument("--state", help="state directory for model slots (default ~/.edgeflow/device/<id>)")
    p.add_argument("--telemetry-interval", type=float, help="seconds between telemetry messages (default 10)")
    p.add_argument("--battery-file", help="sysfs power_supply dir or a file holding the battery percentage")
    p.add_argument("--memory-budget-mb", type=int, help="memory budget override (less than the profile's)")
    p.add_argument("--backend", choices=["ort", "numpy"], help="force a backend")
    p.add_argument("--train-data", help=".npz with arrays x and y: take part in federated rounds on them (from the "
                   "first deployed model on, no command needed)")
    p.add_argument("--app", metavar="FILE_OR_MODULE:client_fn",
                   help="take part in federated rounds with your own Flower-style client: client_fn(context) returns "
                   "an object with get_parameters/fit/evaluate (docs/flower.md); no deployed model needed")
    p.add_argument("--node-config", metavar="'K=V ...'",
                   help="with --app: context.node_config, as Flower's, e.g. 'partition-id=0 num-partitions=2'")
    p.add_argument("--no-train", action="store_true",
                   help="never take part in federated rounds (no command can change that; not with --train-data)")
    p.set_defaults(func=cmd)


def _participant_factory(path: str):
    from ..data import load_npz

    ds = load_npz(path)
    data = (ds.x, ds.y)

    def make(agent):
        from ..federated import Client

        return Client(agent.transport, fleet=agent.fleet, device_id=agent.device_id, signer=agent.signer,
                      fleet_key=agent.fleet_key, model=str(agent.train_model_path), data=data, profile=agent.profile,
                      epoch_file=agent.slots.root / "gateway_epoch.json")

    return make


def _app_factory(ref: str, node_config: dict, device_id: str):
    """The user's client, built once now (a bad reference or a client_fn that raises stops the start with one
    line), and a participant factory that needs no deployed model."""
    import hashlib

    from ..federated.app import Context, load_client_fn, make_client

    node_id = int.from_bytes(hashlib.sha256(device_id.encode()).digest()[:8], "big") >> 1
    app = make_client(load_client_fn(ref), Context(node_id=node_id, node_config=node_config), ref)

    def make(agent):
        from ..federated import Client

        return Client(agent.transport, fleet=agent.fleet, device_id=agent.device_id, signer=agent.signer,
                      fleet_key=agent.fleet_key, app=app, profile=agent.profile,
                      epoch_file=agent.slots.root / "gateway_epoch.json")

    make.needs_model = False  # type: ignore[attr-defined]  # read by the agent's TrainingService
    return make


def cmd(args) -> int:
    import signal
    import sys
    import threading

    from ..device.agent import AgentOptions, DeviceAgent
    from ..errors import ConfigError
    from .profile import runtime_parts

    opts = AgentOptions()
    if args.telemetry_interval is not None:
        if not 0.05 <= args.telemetry_interval <= 86400:
            raise ConfigError(f"--telemetry-interval {args.telemetry_interval:g}: give seconds between 0.05 and 86400")
        opts.telemetry_interval_s = args.telemetry_interval
    if args.memory_budget_mb is not None and args.memory_budget_mb < 1:
        raise ConfigError(f"--memory-budget-mb {args.memory_budget_mb}: give megabytes, 1 or more")
    if args.no_train and args.train_data:
        raise ConfigError("--no-train and --train-data contradict each other: drop one")
    if args.app and (args.train_data or args.no_train):
        raise ConfigError(f"--app and {'--train-data' if args.train_data else '--no-train'} contradict each other: "
                          "--app brings its own data and training; drop one")
    if args.node_config and not args.app:
        raise ConfigError("--node-config is the context of a Flower-style client: give --app FILE:client_fn too")
    from ..federated.app import parse_config_text

    node_config = parse_config_text(args.node_config, "--node-config")
    if args.battery_file:
        opts.battery_file = args.battery_file
    if args.memory_budget_mb is not None:
        opts.memory_budget_mb = args.memory_budget_mb
    if args.backend:
        opts.backend = args.backend
    opts.train = not args.no_train
    factory = _participant_factory(args.train_data) if args.train_data else None
    agent = DeviceAgent.from_credentials(args.credentials, broker=args.broker, profile=args.profile,
                                         state_dir=args.state, options=opts, make_participant=factory)
    if args.app:
        agent.make_participant = _app_factory(args.app, node_config, agent.device_id)
    done = threading.Event()

    def on_signal(signum, frame) -> None:  # noqa: ARG001
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.start(connect=False)
    agent.transport.connect(wait=False)
    v = agent.model_version
    print(f"edgeflow device {agent.device_id}: profile {agent.profile.name}, model "
          f"{'v' + str(v) if v is not None else 'none yet'}, broker {agent.transport.url}", file=sys.stderr, flush=True)
    for part in runtime_parts():  # a board without onnxruntime/onnx/cryptography wheels says so at start
        if not part["ok"]:
            print(f"  missing: {part['part']}: {part['using']}; instead: {part['instead']}", file=sys.stderr, flush=True)
    for note in agent.boot_notes:
        print(f"  boot: {note}", file=sys.stderr, flush=True)
    code, detail = agent.train_status()
    if code == "training":
        print("  federated rounds: taking part", file=sys.stderr, flush=True)
    elif code == "no_model" and (args.train_data or args.app) and not args.no_train:
        print("  federated rounds: taking part once a model is deployed", file=sys.stderr, flush=True)
    else:
        print(f"  federated rounds: not taking part: {detail}", file=sys.stderr, flush=True)
    while not done.wait(0.5):
        if getattr(agent.transport, "gave_up", None) is not None:  # e.g. its client id is taken: one line, exit 2
            break
    agent.stop()
    if getattr(agent.transport, "gave_up", None) is not None:
        raise agent.transport.gave_up
    return 0
