"""A set of pages for OCR, rendered here with fonts from Debian's packages (fonts-liberation2,
fonts-urw-base35, fonts-comic-neue, fonts-roboto-unhinted, fonts-dejavu-core): serif, sans, mono,
condensed, bold and handwriting-like faces at several sizes, a slightly rotated page, a camera's
overlay on a photo, two columns and a receipt. The ground truth is what the renderer drew, line by
line in reading order (a column read to its end before the next); `accuracy` scores a reading
against it, spaces included.

    from ocr_pages import pages, accuracy
    for name, (png, lines) in pages().items(): ...
"""
import io
import os

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

FONTS = {
    "serif": "/usr/share/fonts/truetype/liberation2/LiberationSerif-Regular.ttf",
    "sans": "/usr/share/fonts/truetype/liberation2/LiberationSans-Regular.ttf",
    "mono": "/usr/share/fonts/truetype/liberation2/LiberationMono-Regular.ttf",
    "condensed": "/usr/share/fonts/truetype/roboto/unhinted/RobotoCondensed-Regular.ttf",
    "narrow": "/usr/share/fonts/opentype/urw-base35/NimbusSansNarrow-Regular.otf",
    "bold": "/usr/share/fonts/opentype/urw-base35/NimbusSans-Bold.otf",
    "hand": "/usr/share/fonts/opentype/comic-neue/ComicNeue-Regular.otf",
    "book": "/usr/share/fonts/opentype/urw-base35/P052-Roman.otf",
    "century": "/usr/share/fonts/opentype/urw-base35/C059-Roman.otf",
    "dejavu_serif": "/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf",
    "nimbus_mono": "/usr/share/fonts/opentype/urw-base35/NimbusMonoPS-Regular.otf",
}
PHOTOS = os.path.join(os.path.dirname(__file__), "..", "..", "third_party", "real-models", "photos")


def _font(name, size):
    return ImageFont.truetype(FONTS[name], size)


def _png(img):
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def _lines_page(lines, width, margin=40, spacing=1.8, background="white", fill="black"):
    """One text line per (text, font, size), left-aligned, top to bottom."""
    height = int(sum(size * spacing for _, _, size in lines)) + 2 * margin
    img = Image.new("RGB", (width, height), background)
    d = ImageDraw.Draw(img)
    y = margin
    for text, font, size in lines:
        d.text((margin, y), text, font=_font(font, size), fill=fill)
        y += int(size * spacing)
    return img, [t for t, _, _ in lines]


def invoice():
    lines = [("Invoice 4471: paid in full", "serif", 34),
             ("Date: 2026-03-14   Total: $1,249.50", "serif", 26),
             ("Bill to: Ada Lovelace, 12 Analytical Row", "serif", 26),
             ("Model: Aurora 3 Pro (2026)", "serif", 26),
             ("Thank you for your business.", "serif", 22)]
    return _lines_page(lines, 900)


def sans_sizes():
    lines = [("Quarterly report", "sans", 44), ("Revenue grew 12% to 4.2 million", "sans", 28),
             ("Costs fell in every region but one", "sans", 20),
             ("See page 7 for the full table.", "sans", 16)]
    return _lines_page(lines, 820)


def dense():
    """A paragraph set as books set it: lines 1.2 times the font size apart."""
    lines = [("Millstones were cut from hard rock", "sans", 22), ("and dressed with furrows that carry", "sans", 22),
             ("the meal from the eye to the skirt,", "sans", 22), ("where it falls into the case below.", "sans", 22),
             ("A good miller could hear the stones", "sans", 22), ("running too close and lift them.", "sans", 22)]
    return _lines_page(lines, 700, spacing=1.2)


def mono():
    lines = [("gRPC bytes OK", "dejavu_serif", 40), ("$ quern serve --port 8000", "mono", 24),
             ("status=200 latency_ms=14.7", "mono", 24), ("GET /v2/health/ready", "nimbus_mono", 26)]
    return _lines_page(lines, 860)


def condensed_bold():
    lines = [("WAREHOUSE CLEARANCE SALE", "bold", 40), ("All shelving units 30% off", "condensed", 30),
             ("Open Monday to Saturday, 9am-6pm", "narrow", 28), ("Parking at the rear entrance", "condensed", 24)]
    return _lines_page(lines, 880)


def handwriting():
    lines = [("Dear Sam, thanks for the lovely", "hand", 34), ("dinner on Friday. See you soon!", "hand", 34),
             ("Love, Jo", "hand", 30)]
    return _lines_page(lines, 760)


def rotated():
    img, truth = _lines_page([("The mill grinds grain in batches", "book", 30),
                              ("Each stone turns at its own pace", "book", 30),
                              ("Flour is sifted twice", "book", 30)], 760, margin=60)
    return img.rotate(2.5, resample=Image.BICUBIC, expand=True, fillcolor="white"), truth


def camera_overlay():
    """A camera's timestamp and name burnt into a photo: white text with a dark outline."""
    photo = Image.open(os.path.join(PHOTOS, "horses.jpg")).convert("RGB")
    d = ImageDraw.Draw(photo)
    truth = ["2026-11-28 13:45:02", "Front Gate Camera 2"]
    for (text, y) in zip(truth, (12, photo.height - 50)):
        d.text((14, y), text, font=_font("sans", 30), fill="white", stroke_width=2, stroke_fill="black")
    return photo, truth


def two_columns():
    left = ["Grain arrives at", "the mill before", "dawn and is", "weighed at once."]
    right = ["Stones are dressed", "every spring by", "hand, with a", "steel pick."]
    img = Image.new("RGB", (900, 480), "white")
    d = ImageDraw.Draw(img)
    f = _font("century", 28)
    d.text((260, 30), "A Short History of Milling", font=_font("century", 34), fill="black")
    for i, (a, b) in enumerate(zip(left, right)):
        d.text((40, 140 + 70 * i), a, font=f, fill="black")
        d.text((500, 140 + 70 * i), b, font=f, fill="black")
    return img, ["A Short History of Milling"] + left + right


def screen():
    """A screenshot's menu and table: short words, 18 px, on light grey (words a direction classifier
    shown the crop's margin takes for upside down)."""
    img = Image.new("RGB", (900, 260), (245, 245, 245))
    d = ImageDraw.Draw(img)
    f = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", 18)
    menu = ["File", "Edit", "View", "Models", "Help"]
    for i, m in enumerate(menu):
        d.text((20 + 130 * i, 10), m, font=f, fill="black")
    rows = [["Request001", "37ms", "loading"], ["Request005", "85ms", "failed"], ["Request006", "22ms", "ready"]]
    for r, row in enumerate(rows):
        for x, word in zip((60, 360, 560), row):
            d.text((x, 80 + 48 * r), word, font=f, fill="black")
    return img, menu + [w for row in rows for w in row]


def receipt():
    rows = [("Rye loaf", "4.20"), ("Spelt flour 1kg", "3.85"), ("Oat biscuits", "2.10"), ("Honey jar", "6.50")]
    img = Image.new("RGB", (560, 520), (250, 248, 240))
    d = ImageDraw.Draw(img)
    f, big = _font("nimbus_mono", 24), _font("bold", 30)
    d.text((150, 24), "CORNER BAKERY", font=big, fill="black")
    truth = ["CORNER BAKERY"]
    y = 100
    for item, price in rows:
        d.text((30, y), item, font=f, fill="black")
        d.text((420, y), price, font=f, fill="black")
        truth += [item, price]
        y += 50
    d.text((30, y + 20), "TOTAL", font=big, fill="black")
    d.text((400, y + 20), "16.65", font=big, fill="black")
    truth += ["TOTAL", "16.65"]
    img = img.filter(ImageFilter.GaussianBlur(0.6))  # a thermal print, photographed
    return img, truth


BUILDERS = {"invoice (serif)": invoice, "report (sans, 16-44 px)": sans_sizes, "terminal (mono)": mono,
            "dense paragraph (sans 22 px)": dense,
            "sale (bold, condensed)": condensed_bold, "note (handwriting-like)": handwriting,
            "rotated 2.5 degrees": rotated, "camera overlay on a photo": camera_overlay,
            "two columns": two_columns, "receipt": receipt, "menu and table (sans 18 px)": screen}


def pages():
    """{name: (PNG bytes, [lines of the ground truth in reading order])}"""
    out = {}
    for name, build in BUILDERS.items():
        img, truth = build()
        out[name] = (_png(img), truth)
    return out


def _distance(a, b):
    """Levenshtein distance between two strings."""
    prev = np.arange(len(b) + 1)
    for i, ca in enumerate(a, 1):
        cur = np.empty_like(prev)
        cur[0] = i
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
        prev = cur
    return int(prev[-1])


def accuracy(read_lines, truth_lines):
    """Character accuracy of a reading, spaces included: 1 - edit distance / truth length over the
    lines joined by one space each (so a line read as one prediction or as its words scores the
    same; a word read out of order or a dropped space costs)."""
    got = " ".join(" ".join(read_lines).split())
    want = " ".join(" ".join(truth_lines).split())
    return max(0.0, 1.0 - _distance(got, want) / max(1, len(want)))
