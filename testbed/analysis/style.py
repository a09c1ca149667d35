"""One look for every figure the testbed draws (`report`, `compare`, `campaign`, `simulate`): two styles,
fixed colours, labels in words with units, integer ticks, centred bars, captions beside the files.

- Styles: `paper` (one column, 3.5 in wide, 8 pt fonts, no titles: the caption carries them) and `screen`
  (wider, titles on top). `using(style, formats)` sets the style and the file formats (pdf, svg, png) for
  the figures drawn inside it; every plotting function reads them through `current()`.
- Colours: the Okabe-Ito palette (told apart with every common colour-vision deficiency). A policy, a
  device, a mode and a phase have one colour in every figure: known policies and phases fixed, other names
  by a stable hash (crc32, not Python's salted `hash`) into the palette; devices named with a number
  (dev0, dev1) by that number, or with one letter (a, b) by the letter, so that up to seven devices never
  share one.
- `label(field)`: a record's field name in words with its unit ("uplink_phase_s" -> "uplink phase [s]").
- `save(fig, path, caption)`: the figure in each format, and `<figure>.caption.txt` beside it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

# matplotlib's PDF backend subsets fonts with fontTools, which logs every table it touches at INFO: pages of
# lines under `multispin report --format pdf` at the default log level.
logging.getLogger("fontTools").setLevel(logging.WARNING)

# Okabe & Ito (2008), "Color Universal Design".
ORANGE, SKY_BLUE, BLUISH_GREEN, YELLOW = "#E69F00", "#56B4E9", "#009E73", "#F0E442"
BLUE, VERMILLION, REDDISH_PURPLE, BLACK, GREY = "#0072B2", "#D55E00", "#CC79A7", "#000000", "#999999"
PALETTE = (BLUE, ORANGE, BLUISH_GREEN, VERMILLION, REDDISH_PURPLE, SKY_BLUE, BLACK, YELLOW)

# The modes: UL blue, DL orange, everywhere (a policy that fixes a mode takes the mode's colour).
MODE_COLORS = {"UL": BLUE, "DL": ORANGE, "mixed": BLUISH_GREEN, "missed": "#D9D9D9"}
POLICY_COLORS = {
    "proposed": VERMILLION, "all-ul": BLUE, "all-dl": ORANGE, "common-length": BLUISH_GREEN,
    "fixed-length": REDDISH_PURPLE, "proposed-basic": SKY_BLUE, "exhaustive": BLACK,
    "multispin-homogeneous": GREY, "multispin-heterogeneous": YELLOW,
}
# Devices: not blue or orange, the modes of the timeline they are drawn beside.
DEVICE_PALETTE = (BLUISH_GREEN, REDDISH_PURPLE, VERMILLION, SKY_BLUE, BLACK, GREY, YELLOW)
PHASE_COLORS = {
    "draft_s": BLUISH_GREEN, "ul_air_s[UL mode]": BLUE, "ul_air_s[DL mode]": SKY_BLUE, "uplink_phase_s": BLACK,
    "dl_air_s[DL mode, p]": ORANGE, "verify_s": REDDISH_PURPLE, "round_s": VERMILLION, "goodput_tps": GREY,
}
# Measured against predicted: the same series in two line styles.
MEASURED_STYLE = {"ls": "-", "marker": "o"}
PREDICTED_STYLE = {"ls": "--", "marker": "o", "mfc": "white"}
RUN_LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 1)))


def _hashed(name: str, palette: tuple[str, ...]) -> str:
    return palette[zlib.crc32(name.encode()) % len(palette)]


def policy_color(policy: str) -> str:
    """One colour per policy in every figure: the known ones fixed, a plug-in's by a stable hash."""
    return POLICY_COLORS.get(policy) or _hashed(str(policy), PALETTE)


def device_color(name: str) -> str:
    """One colour per device in every figure: by the number it ends in (dev0, dev1, ...), else hashed."""
    m = re.search(r"(\d+)$", str(name))
    if m:
        return DEVICE_PALETTE[int(m[1]) % len(DEVICE_PALETTE)]
    if re.fullmatch(r"[a-z]", str(name)):  # devices a, b, c: by the letter
        return DEVICE_PALETTE[(ord(name) - ord("a")) % len(DEVICE_PALETTE)]
    return _hashed(str(name), DEVICE_PALETTE)


def phase_color(phase: str) -> str:
    return PHASE_COLORS.get(phase) or _hashed(phase, PALETTE)


def series_color(index: int) -> str:
    """The i-th of several runs in an overlay."""
    return PALETTE[index % len(PALETTE)]


# -- labels -----------------------------------------------------------------------------------------------

# A record's field -> (words, unit); the unit goes in brackets after the words.
FIELDS = {
    "round": ("round", None),
    "draft_s": ("drafting time", "s"),
    "ul_air_s": ("uplink air time", "s"),
    "uplink_phase_s": ("uplink phase", "s"),
    "dl_air_s": ("downlink air time", "s"),
    "downlink_phase_s": ("downlink phase", "s"),
    "verify_s": ("verification time", "s"),
    "round_s": ("round time", "s"),
    "goodput_tps": ("goodput", "tokens/s"),
    "measured_goodput_tps": ("goodput, measured", "tokens/s"),
    "predicted_goodput_tps": ("goodput, predicted", "tokens/s"),
    "mc_goodput_tps": ("goodput, Monte Carlo", "tokens/s"),
    "tokens_per_j": ("tokens per joule", "tokens/J"),
    "measured_tokens_per_j": ("tokens per joule, all devices", "tokens/J"),
    "num_ul_devices": ("UL-mode devices $K$", None),
    "ul_share": ("share of devices in UL mode $K/N$", None),
    "tx_j": ("transmit energy", "J"),
    "rx_j": ("receive energy", "J"),
    "compute_j": ("compute energy", "J"),
    "energy_j": ("energy per round", "J"),
    "ul_rate_bps": ("uplink rate", "Mbit/s"),
    "dl_rate_bps": ("downlink rate", "Mbit/s"),
    "rate_mbps": ("rate", "Mbit/s"),
    "draft_len": ("draft length $L$", "tokens"),
    "relative_error": ("relative error (measured − predicted) / predicted", "%"),
    "cdf": ("fraction of samples", None),
    # names of earlier releases
    "uplink_s": ("uplink air time", "s"), "up_phase_s": ("uplink phase", "s"), "downlink_s": ("downlink air time", "s"),
}
_QUALIFIERS = {"UL mode": "UL-mode devices", "DL mode": "DL-mode devices", "p": "distribution sent"}


def words(field: str) -> str:
    """A field or phase name in words without its unit ('ul_air_s[DL mode]' -> 'uplink air time, DL-mode
    devices'); an unknown name as it is."""
    base, _, rest = field.partition("[")
    text = FIELDS.get(base, (base, None))[0]
    quals = [_QUALIFIERS.get(q.strip(), q.strip()) for q in rest.rstrip("]").split(",") if q.strip()]
    return ", ".join([text, *quals])


def unit(field: str) -> str | None:
    return FIELDS.get(field.partition("[")[0], (None, None))[1]


def label(field: str, unit_override: str | None = None) -> str:
    """'uplink_phase_s' -> 'uplink phase [s]'; `unit_override` for a scaled axis ('ms')."""
    u = unit_override or unit(field)
    return f"{words(field)} [{u}]" if u else words(field)


# -- styles and the figures' settings -------------------------------------------------------------------

@dataclass(frozen=True)
class Style:
    name: str
    width_in: float          # one panel; a figure of several panels takes `wide_in`
    wide_in: float
    font_pt: float
    titles: bool             # a title on top (screen); paper leaves it to the caption
    dpi: int                 # of the PNG
    line_w: float
    marker: float

    def rc(self) -> dict:
        f = self.font_pt
        return {"font.size": f, "axes.titlesize": f, "axes.labelsize": f, "xtick.labelsize": f,
                "ytick.labelsize": f, "legend.fontsize": f, "legend.title_fontsize": f, "figure.titlesize": f + 1,
                "lines.linewidth": self.line_w, "lines.markersize": self.marker, "axes.grid": True,
                "grid.alpha": 0.3, "axes.prop_cycle": _cycler(), "pdf.fonttype": 42, "ps.fonttype": 42,
                "svg.hashsalt": "multispin", "savefig.bbox": "tight", "savefig.pad_inches": 0.03,
                "axes.spines.top": self.name != "paper", "axes.spines.right": self.name != "paper"}


def _cycler():
    from cycler import cycler

    return cycler(color=list(PALETTE))


STYLES = {
    "paper": Style("paper", width_in=3.5, wide_in=7.16, font_pt=8.0, titles=False, dpi=300, line_w=1.0,
                   marker=3.0),
    "screen": Style("screen", width_in=7.5, wide_in=12.0, font_pt=10.0, titles=True, dpi=130, line_w=1.4,
                    marker=4.0),
}
FORMATS = ("pdf", "svg", "png")
DEFAULT_STYLE, DEFAULT_FORMATS = "screen", ("png",)
_current: dict = {"style": DEFAULT_STYLE, "formats": DEFAULT_FORMATS}


def parse_formats(text: str | list | tuple | None) -> tuple[str, ...]:
    """'pdf,svg,png' -> ('pdf', 'svg', 'png'); ValueError naming the known formats for another."""
    if text is None:
        return DEFAULT_FORMATS
    items = text.split(",") if isinstance(text, str) else list(text)
    out = tuple(dict.fromkeys(x.strip().lower().lstrip(".") for x in items if x.strip()))
    bad = [x for x in out if x not in FORMATS]
    if bad or not out:
        raise ValueError(f"--format {text}: give one or more of {', '.join(FORMATS)}, comma-separated")
    return out


def current() -> Style:
    return STYLES[_current["style"]]


def formats() -> tuple[str, ...]:
    return _current["formats"]


@contextlib.contextmanager
def using(style: str | None = None, fmt: str | tuple | list | None = None):
    """The style and formats of every figure drawn inside; None keeps the one in force."""
    if style is not None and style not in STYLES:
        raise ValueError(f"--style {style}: one of {', '.join(STYLES)}")
    before = dict(_current)
    if style is not None:
        _current["style"] = style
    if fmt is not None:
        _current["formats"] = parse_formats(fmt)
    try:
        yield current()
    finally:
        _current.clear()
        _current.update(before)


def figure(panels: tuple[int, int] = (1, 1), aspect: float = 0.62, wide: bool | None = None,
           height: float | None = None, **kw):
    """(fig, axes) in the current style: one panel across the style's width (a paper column), several across
    its wide width; `aspect` is the height of one panel over its width."""
    import matplotlib.pyplot as plt

    st = current()
    rows, cols = panels
    wide = cols > 1 if wide is None else wide
    width = st.wide_in if wide else st.width_in
    h = height if height is not None else rows * width / cols * aspect + (0.2 if st.titles else 0.0)
    with rc():
        return plt.subplots(rows, cols, figsize=(width, h), **kw)


def rc():
    """A context with the current style's rcParams (figures and artists made inside take them)."""
    import matplotlib

    return matplotlib.rc_context(current().rc())


def styled(fn):
    """Draw `fn`'s figure under the current style's rcParams (fonts, lines, palette)."""
    import functools

    @functools.wraps(fn)
    def inner(*a, **kw):
        with rc():
            return fn(*a, **kw)

    return inner


def title(target, text: str, **kw) -> None:
    """A title on an axes or a figure (suptitle) in the screen style; none in the paper style."""
    if not current().titles or not text:
        return
    if hasattr(target, "suptitle"):
        target.suptitle(text, **kw)
    else:
        target.set_title(text, **kw)


def integer_ticks(ax, axis: str = "x") -> None:
    """Ticks at whole numbers only (rounds, devices, tokens)."""
    from matplotlib.ticker import MaxNLocator

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))


def bar_offsets(series: int, group_width: float = 0.8) -> tuple[list[float], float]:
    """(offset of each of `series` bars from its group's tick, bar width): the bars of a group centred on it."""
    w = group_width / max(series, 1)
    return [(k - (series - 1) / 2) * w for k in range(series)], w


def spread_note(n: int, what: str = "runs", interval: str = "bars: min to max") -> str:
    """What an interval is drawn from, with its count: 'mean of 3 drops; bars: min to max'; with one, none.
    Two are named as two: an interval from two samples is wide and says little."""
    if n <= 1:
        return f"one {what.rstrip('s')} per point (no interval)"
    few = " (only 2: a weak interval)" if n == 2 else ""
    return f"mean of {n} {what}{few}; {interval}"


# A legend of more entries than this goes below a paper column's axes: inside, 8 entries in 2 columns covered
# half of a 3.5 in panel's data (the Qwen campaign's goodput figure).
PAPER_LEGEND_INSIDE_MAX = 4


def legend(ax, note: str | None = None, **kw):
    """The axes' legend, with `note` (e.g. `spread_note`) as its title; in the paper style a long one goes below
    the axes (unless the caller placed it)."""
    if note:
        kw.setdefault("title", note)
    handles = kw.get("handles") or ax.get_legend_handles_labels()[0]
    if current().name == "paper" and "loc" not in kw and len(handles) > PAPER_LEGEND_INSIDE_MAX:
        kw.update(loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    leg = ax.legend(**kw)
    if leg is not None and note:
        leg.get_title().set_fontsize(current().font_pt)
    return leg


def save(fig, path: str | Path, caption: str) -> list[Path]:
    """The figure as `<stem>.<format>` for each format in force (`path`'s own suffix is replaced) and its
    caption as `<stem>.caption.txt`; closes the figure; returns the figure files (the caption file apart)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    stem = path.with_suffix("") if path.suffix.lstrip(".") in FORMATS else path
    stem.parent.mkdir(parents=True, exist_ok=True)
    out = []
    st = current()
    with rc():
        for fmt in formats():
            p = stem.with_name(f"{stem.name}.{fmt}")
            meta = {"svg": {"Date": None}, "pdf": {"CreationDate": None, "ModDate": None}}.get(fmt, {})
            fig.savefig(p, dpi=st.dpi, metadata=meta or None)
            out.append(p)
    caption_path(stem).write_text(caption.strip() + "\n")
    plt.close(fig)
    return out


def caption_path(figure_path: str | Path) -> Path:
    p = Path(figure_path)
    stem = p.with_suffix("") if p.suffix.lstrip(".") in FORMATS else p
    return stem.with_name(f"{stem.name}.caption.txt")


def captions(paths: list[Path]) -> dict[str, str]:
    """{figure stem: caption} of the figures among `paths` that have one (each stem once)."""
    out = {}
    for p in paths:
        c = caption_path(p)
        if c.name not in out and c.is_file():
            out[c.name[:-len(".caption.txt")]] = c.read_text().strip()
    return out
