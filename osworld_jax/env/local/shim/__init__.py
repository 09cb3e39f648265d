"""Modules put on the jail's ``PYTHONPATH``, run by the jail's system python3.

Never imported on the host: ``pyautogui`` is the project's own xdotool-backed subset of PyAutoGUI.
"""
