"""The local supervisor behind `make up`: nats-server plus the services as restarted processes.

    python -m asyncrl.supervisor start [--var var] [--services scheduler,reward,rollout,trainer]
    python -m asyncrl.supervisor ps | logs [SERVICE] [-f] | scale SERVICE N | stop

`daemon` holds the process supervision (pure restart policy, replica bookkeeping); `commands`
the CLI that starts, inspects and stops it.
"""

from asyncrl.supervisor.daemon import Paths, Supervisor, backoff_s, pid_alive, port_in_use

__all__ = ["Paths", "Supervisor", "backoff_s", "pid_alive", "port_in_use"]
