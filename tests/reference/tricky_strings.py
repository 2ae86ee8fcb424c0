"""Strings that break careless tokenizers: code, unicode, digits, whitespace, specials."""

TRICKY_STRINGS = [
    "def f(x):\n    return x**2  # square\n",
    "\tindented\twith tabs\n\n\nand blank lines   trailing   ",
    "1234567890 3.14159 -42 1e-9 0x1F",
    "naïve café — “quotes” … 東京 مرحبا 🙂👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n",
    "if (a && b || !c) { return a->b[0]; } // C++ <vector<int>>",
    "    ",
    "Hello",
]
