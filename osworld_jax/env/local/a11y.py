"""The accessibility tree for the in-jail server: at-spi (pyatspi) -> OSWorld-style XML.

This file runs INSIDE the bubblewrap jail with the system ``python3`` (standard library plus,
lazily, Debian's ``python3-pyatspi``); it must not import ``osworld_jax``. ``vmserver.py``
serves it.
"""

from __future__ import annotations

import threading
import xml.etree.ElementTree as ET

_STATE: dict = {}
_A11Y_LOCK = threading.Lock()

NS = {
    "st": "https://accessibility.ubuntu.example.org/ns/state",
    "attr": "https://accessibility.ubuntu.example.org/ns/attributes",
    "cp": "https://accessibility.ubuntu.example.org/ns/component",
    "doc": "https://accessibility.ubuntu.example.org/ns/document",
    "docattr": "https://accessibility.ubuntu.example.org/ns/document/attributes",
    "txt": "https://accessibility.ubuntu.example.org/ns/text",
    "val": "https://accessibility.ubuntu.example.org/ns/value",
    "act": "https://accessibility.ubuntu.example.org/ns/action",
}
for _prefix, _uri in NS.items():
    ET.register_namespace(_prefix, _uri)


def _q(ns: str, name: str) -> str:
    """An ElementTree qualified name in one of the OSWorld a11y namespaces."""
    return "{" + NS[ns] + "}" + name


MAX_DEPTH = 50
MAX_WIDTH = 1024
MAX_NODES = 5000
TABLE_ROWS = 200
TABLE_COLS = 60


def _pyatspi():
    import pyatspi  # python3-pyatspi; imported lazily (slow) and only when asked for

    if not _STATE.get("atspi_timeout_set"):
        try:
            pyatspi.setTimeout(3000, 10000)
        except Exception:
            pass
        _STATE["atspi_timeout_set"] = True
    return pyatspi


def _node_xml(node, pyatspi, depth: int, budget: list) -> ET.Element:
    budget[0] -= 1
    attrs = {"name": node.name or ""}
    states = node.getState().getStates()
    for st in states:
        sname = pyatspi.StateType._enum_lookup.get(int(st), "")
        sname = sname.split("_", 1)[1].lower() if "_" in sname else ""
        if sname:
            attrs[_q("st", sname)] = "true"
    try:
        for key, value in (node.get_attributes() or {}).items():
            if key:
                attrs[_q("attr", key)] = str(value)
    except Exception:
        pass
    if attrs.get(_q("st", "visible")) == "true" and attrs.get(_q("st", "showing")) == "true":
        try:
            comp = node.queryComponent()
            x, y, w, h = comp.getExtents(pyatspi.XY_SCREEN)
            attrs[_q("cp", "screencoord")] = str((x, y))
            attrs[_q("cp", "size")] = str((w, h))
        except Exception:
            pass
    text = ""
    try:
        t = node.queryText()
        text = t.getText(0, t.characterCount).replace("\ufffc", "").replace("\ufffd", "")
    except Exception:
        pass
    for probe, key in (("queryImage", "image"), ("querySelection", "selection")):
        try:
            getattr(node, probe)()
            attrs[key] = "true"
        except Exception:
            pass
    try:
        v = node.queryValue()
        for key, getter in (
            ("value", lambda: v.currentValue),
            ("min", lambda: v.minimumValue),
            ("max", lambda: v.maximumValue),
            ("step", lambda: v.minimumIncrement),
        ):
            try:
                attrs[_q("val", key)] = str(getter())
            except Exception:
                pass
    except Exception:
        pass
    try:
        a = node.queryAction()
        for i in range(a.nActions):
            aname = a.getName(i).replace(" ", "-")
            attrs[_q("act", aname + "_desc")] = a.getDescription(i)
            attrs[_q("act", aname + "_kb")] = a.getKeyBinding(i)
    except Exception:
        pass
    role = (node.getRoleName().strip() or "unknown").replace(" ", "-")
    el = ET.Element(role, attrs)
    if text:
        el.text = text
    if depth >= MAX_DEPTH or budget[0] <= 0:
        return el
    try:
        count = node.childCount
    except Exception:
        return el
    if role == "table" and count > MAX_WIDTH:
        _table_children(node, el, pyatspi, depth, budget)
        return el
    for i in range(min(count, MAX_WIDTH)):
        if budget[0] <= 0:
            break
        try:
            child = node.getChildAtIndex(i)
            if child is not None:
                el.append(_node_xml(child, pyatspi, depth + 1, budget))
        except Exception:
            continue
    return el


def _table_children(node, el, pyatspi, depth, budget) -> None:
    """Showing cells of a huge table (a spreadsheet): the first TABLE_ROWS x TABLE_COLS."""
    try:
        table = node.queryTable()
    except Exception:
        return
    for r in range(min(table.nRows, TABLE_ROWS)):
        row_seen = False
        for c in range(min(table.nColumns, TABLE_COLS)):
            if budget[0] <= 0:
                return
            cell = table.getAccessibleAt(r, c)
            if cell is None or not cell.getState().contains(pyatspi.STATE_SHOWING):
                if row_seen:
                    break
                continue
            row_seen = True
            el.append(_node_xml(cell, pyatspi, depth + 1, budget))


def accessibility_xml() -> str:
    """The desktop's a11y tree; an empty tree with a ``note`` when at-spi is unavailable."""
    root = ET.Element("desktop-frame")
    try:
        with _A11Y_LOCK:
            pyatspi = _pyatspi()
            desktop = pyatspi.Registry.getDesktop(0)
            budget = [MAX_NODES]
            for i in range(desktop.childCount):
                app = desktop.getChildAtIndex(i)
                if app is not None:
                    root.append(_node_xml(app, pyatspi, 1, budget))
    except Exception as e:  # at-spi down or broken: an explicit, empty tree
        root = ET.Element("desktop-frame", {"note": f"accessibility unavailable: {e!r}"[:500]})
    return ET.tostring(root, encoding="unicode")


#: Most accessibility nodes the terminal search visits per frame; it never enters a table or a
#: node with more children than ``_TERMINAL_MAX_CHILDREN`` (a spreadsheet's table has billions
#: of cells: an exhaustive search of a Calc window never ends).
_TERMINAL_BUDGET = 5000
_TERMINAL_MAX_CHILDREN = 500


def _focused_terminal(frame, pyatspi):
    """The focused ``terminal`` node under ``frame`` (breadth first, bounded), or None."""
    queue, seen = [frame], 0
    while queue and seen < _TERMINAL_BUDGET:
        node = queue.pop(0)
        seen += 1
        if node is None:
            continue
        role = node.getRoleName()
        if role == "terminal" and node.getState().contains(pyatspi.STATE_FOCUSED):
            return node
        if role in ("table", "tree table") or node.childCount > _TERMINAL_MAX_CHILDREN:
            continue
        queue.extend(node.getChildAtIndex(k) for k in range(node.childCount))
    return None


def terminal_text() -> str | None:
    """Text of the focused terminal widget in the active frame, or None."""
    try:
        with _A11Y_LOCK:
            pyatspi = _pyatspi()
            desktop = pyatspi.Registry.getDesktop(0)
            for i in range(desktop.childCount):
                app = desktop.getChildAtIndex(i)
                if app is None:
                    continue
                for j in range(app.childCount):
                    frame = app.getChildAtIndex(j)
                    if frame is None or not frame.getState().contains(pyatspi.STATE_ACTIVE):
                        continue
                    hit = _focused_terminal(frame, pyatspi)
                    if hit is not None:
                        t = hit.queryText()
                        return t.getText(0, t.characterCount).rstrip()
    except Exception:
        return None
    return None
