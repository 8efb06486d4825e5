"""The report's PNG: throughput and connect-storm time against client count."""

from __future__ import annotations

from render import val


def _axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # an empty section has no lines
        ax.legend(fontsize=8)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, pts in res["throughput"].items():
        xs = sorted(int(n) for n in pts)
        a.plot(xs, [pts[str(x)]["ops_per_s"] for x in xs], marker="o", label=name)
    _axes(a, "client processes", "ops/s (mixed workload)", "Throughput")
    for name, kinds in res["storm"].items():
        for kind, pts in kinds.items():
            xs = sorted(int(n) for n in pts)
            b.plot(xs, [val(pts[str(x)])["seconds"] for x in xs], marker="o",
                   label=f"{name} ({kind} barrier)")
    _axes(b, "clients", "seconds", "Connect storm: connect + one barrier")
    m = res["machine"]
    fig.suptitle(f"{res['date']} - {m['cores']} cores {m['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
