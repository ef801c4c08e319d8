/* detectors._bestc: the fused ``best`` detector (detectors/best.py) compiled.
 *
 * The same arithmetic as ``PyBest._step`` / ``score_one`` / ``learn_one``, statement for
 * statement and in the same order, on IEEE doubles (no -ffast-math: setup.py), so the
 * scores are bit-identical to the pure-Python class and to the generic Combiner of the
 * seven views (tests/test_detector_contract.py checks all three on the same series).
 * Only the containers differ: the median window is a ring plus a sorted array (memmove
 * insert / delete), the seasonal history a ring, the refractory maxima a ring.
 *
 * The state is exported to and imported from exactly the dict the pure-Python class
 * pickles (``_export`` / ``_import``), so a state saved by either loads into the other.
 * The Python subclass ``detectors.best.Best`` adds pickling and the Detector contract.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

/* Constants of detectors/best.py; best.py asserts CONSTANTS equals its own. */
#define SLOW 0.0003
#define DECAY 0.9999
#define WARMUP 150
#define REFRACTORY 100
#define SMOOTH 48
#define SHORT 12
#define ROBUST_WINDOW 2000
#define KK 3.0
#define CUSUM_ALPHA 0.001
#define DRIFT 0.5
#define HH 5.0
#define CUSUM_MIN 30
#define SEASONAL_MIN 30
#define STEADY 3340
#define SCORE_CAP 1e9
#define MAD_TO_STD 1.4826
#define W0 0.9
#define W4 0.9
#define W5 0.6
#define W6 0.9
#define REFRESH (ROBUST_WINDOW / 8)
#define NF 35
#define BAND 34
#define RCAP 128 /* > REFRACTORY + 1, the most entries the refractory window holds */

/* The scalar state's layout: v[i] is FIELD_NAMES[i]. It must equal detectors/best.py's
 * _FIELDS (step() unpacks and packs it in this order, as PyBest._step does); the module
 * exports it as FIELDS and best.py refuses to load a build whose layout differs. */
static const char *const FIELD_NAMES[NF] = {
    "rec_ewma", "rec_shift", "rec_var", "rec_robust", "rec_cusum", "rec_day", "rec_dayshift",
    "ewma_level", "ewma_rmean", "ewma_rvar", "ewma_rstd",
    "shift_smoothed", "shift_level", "shift_rmean", "shift_rvar", "shift_rstd",
    "var_mean", "var_var", "var_lmean", "var_lvar", "var_lstd", "var_absmean",
    "cusum_mean", "cusum_var", "cusum_std", "cusum_pos", "cusum_neg",
    "day_mean", "day_var", "day_std",
    "dayshift_smoothed", "dayshift_mean", "dayshift_var", "dayshift_std",
    "robust_band",
};

static const double SA = 2.0 / (SMOOTH + 1);
static const double VA = 2.0 / (SHORT + 1);
static const double RB = 1.0 - SLOW;
static const double KMAD = KK * MAD_TO_STD;

/* detectors._stats.exact_sum (math.fsum that never raises on overflow), for the MAD == 0
   fallback: the same function the Python reference calls, so results stay identical */
static PyObject *fsum_func = NULL;
static PyObject *deque_type = NULL; /* collections.deque */

typedef struct {
    PyObject_HEAD
    Py_ssize_t period;
    long long n;            /* finite values learned */
    double v[NF];           /* the scalar state, in best._FIELDS order */
    double *fifo;           /* median window in arrival order: value i at i % ROBUST_WINDOW */
    double *sorted;         /* ... sorted; len = min(n, ROBUST_WINDOW) */
    Py_ssize_t nsorted;
    long long since_mad;
    double *past;           /* seasonal history: value i at i % period */
    long long rec_idx[RCAP]; /* refractory: (index, score), scores decreasing */
    double rec_sc[RCAP];
    int rec_head, rec_len;
    int has_next;           /* score_one's step, reused by learn_one of the same x */
    double next_x, next_score;
    double next_v[NF];
} BestCore;

/* ------------------------------------------------------------------ helpers */

static Py_ssize_t bisect_left(const double *s, Py_ssize_t n, double x) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (s[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static Py_ssize_t bisect_right(const double *s, Py_ssize_t n, double x) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < s[mid]) hi = mid; else lo = mid + 1;
    }
    return lo;
}

/* detectors.robust.mad_of_sorted's k-th smallest deviation */
static double kth(const double *s, Py_ssize_t p, Py_ssize_t na, Py_ssize_t nb, double med,
                  Py_ssize_t k) {
    Py_ssize_t lo = k + 1 - nb > 0 ? k + 1 - nb : 0;
    Py_ssize_t hi = k + 1 < na ? k + 1 : na;
    while (lo < hi) {
        Py_ssize_t i = (lo + hi) / 2;
        if (med - s[p - 1 - i] < s[p + k - i] - med) lo = i + 1; else hi = i;
    }
    Py_ssize_t i = lo, j = k + 1 - lo;
    double a = i > 0 ? med - s[p - i] : -1.0;
    double b = j > 0 ? s[p + j - 1] - med : -1.0;
    return a > b ? a : b;
}

static PyObject *fsum_of(const double *s, Py_ssize_t lo, Py_ssize_t hi) {
    PyObject *lst = PyList_New(hi - lo);
    if (!lst) return NULL;
    for (Py_ssize_t i = lo; i < hi; i++) {
        PyObject *f = PyFloat_FromDouble(s[i]);
        if (!f) { Py_DECREF(lst); return NULL; }
        PyList_SET_ITEM(lst, i - lo, f);
    }
    PyObject *r = PyObject_CallOneArg(fsum_func, lst);
    Py_DECREF(lst);
    return r;
}

/* detectors.robust.mad_of_sorted; returns -1.0 with an exception set on error */
static double mad_of_sorted(const double *s, Py_ssize_t n, int *err) {
    *err = 0;
    if (n == 0) return 0.0;
    Py_ssize_t mid = n / 2;
    double med = n % 2 ? s[mid] : 0.5 * (s[mid - 1] + s[mid]);
    Py_ssize_t p = bisect_left(s, n, med);
    Py_ssize_t na = p, nb = n - p;
    double mad = n % 2 ? kth(s, p, na, nb, med, mid)
                       : 0.5 * (kth(s, p, na, nb, med, mid - 1) + kth(s, p, na, nb, med, mid));
    if (mad == 0.0) {
        PyObject *hi = fsum_of(s, p, n), *lo = NULL;
        if (hi) lo = fsum_of(s, 0, p);
        if (!hi || !lo) { Py_XDECREF(hi); Py_XDECREF(lo); *err = 1; return -1.0; }
        double total = (PyFloat_AsDouble(hi) - (double)nb * med) +
                       ((double)na * med - PyFloat_AsDouble(lo));
        Py_DECREF(hi);
        Py_DECREF(lo);
        mad = total / (double)n / MAD_TO_STD;
    }
    return mad;
}

/* x as a double; 0 = ok, 1 = not a number (TypeError, like math.isfinite), -1 = error */
static int as_double(PyObject *o, double *x) {
    if (PyFloat_CheckExact(o)) { *x = PyFloat_AS_DOUBLE(o); return 0; }
    double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) { PyErr_Clear(); return 1; }
        return -1;
    }
    *x = v;
    return 0;
}

/* ------------------------------------------------------------------ the step */

/* |dev| / max(den, 1e-12 * max(1, |level|)), capped at SCORE_CAP: each band view's raw
 * score (detectors._stats.safe_ratio as the views inline it) */
static inline double band_ratio(double dev, double den, double level) {
    double al = level > 0.0 ? level : -level;
    double floor_ = 1e-12 * (al > 1.0 ? al : 1.0);
    double raw = dev / (den > floor_ ? den : floor_);
    return raw < 1e9 ? raw : 1e9;
}

/* the combiner: the largest raw / record * weight so far (raw >= 0, so 0 never wins) */
static inline double top_ratio(double best, double raw, double rec, double w) {
    if (rec > 0.0) {
        double ratio = raw / rec * w; /* w = 1.0 is exact: the same float as raw / rec */
        if (ratio > best) return ratio;
    }
    return best;
}

/* a view's record decays and a larger raw score replaces it */
static inline double decay_record(double rec, double raw) {
    double m = rec * 0.9999;
    return raw > m ? raw : m;
}

/* PyBest._step: the combined score of x (before the refractory rule) and the next state */
static double step(const BestCore *self, double x, double *out) {
    long long n = self->n;
    double r0 = self->v[0], r1 = self->v[1], r2 = self->v[2], r3 = self->v[3],
           r4 = self->v[4], r5 = self->v[5], r6 = self->v[6];
    double lv1 = self->v[7], rm1 = self->v[8], rv1 = self->v[9], rs1 = self->v[10];
    double sm2 = self->v[11], lv2 = self->v[12], rm2 = self->v[13], rv2 = self->v[14],
           rs2 = self->v[15];
    double vm = self->v[16], vv = self->v[17], lm = self->v[18], lvv = self->v[19],
           lsd = self->v[20], am = self->v[21];
    double cm = self->v[22], cv = self->v[23], cs = self->v[24], cp = self->v[25],
           cn = self->v[26];
    double m5 = self->v[27], v5 = self->v[28], s5 = self->v[29];
    double sm6 = self->v[30], m6 = self->v[31], v6 = self->v[32], s6 = self->v[33];
    double band = self->v[34];
    long long n1 = n + 1;
    double a, ra, rb, ac;
    if (n > STEADY) {
        a = ra = 0.0003;
        rb = RB;
        ac = 0.001;
    } else {
        a = 1.0 / (double)n1;
        if (a < 0.0003) a = 0.0003;
        ra = n ? 1.0 / (double)n : 1.0;
        if (ra < 0.0003) ra = 0.0003;
        rb = 1.0 - ra;
        ac = 1.0 / (double)n1;
        if (ac < 0.001) ac = 0.001;
    }
    double amn = cm > 0.0 ? cm : -cm;
    double z;
    if (cs <= 1e-12 * (amn > 1.0 ? amn : 1.0)) {
        z = x == cm ? 0.0 : (x > cm ? 1e9 : -1e9);
    } else {
        z = (x - cm) / cs;
        z = z > 1e9 ? 1e9 : (z < -1e9 ? -1e9 : z);
    }
    double pos = cp + z - DRIFT;
    double neg = cn - z - DRIFT;
    long long ns = n - (long long)self->period;
    double y5 = 0.0, y6 = 0.0;
    if (ns >= 0) {
        y5 = x - self->past[n % self->period];
        y6 = ns ? sm6 + SA * (y5 - sm6) : y5;
    }
    double am_new = am + a * ((x > 0.0 ? x : -x) - am);
    if (!(am_new < INFINITY)) am_new = x > 0.0 ? x : -x;
    double score = 0.0;
    double d, raw, resid, floor_, dev;
    if (n) {
        double res1 = x - lv1;
        double y2 = sm2 + SA * (x - sm2);
        double res2 = y2 - lv2;
        d = x - vm;
        double vm_new = vm + VA * d;
        double vv_new = (1.0 - VA) * (vv + VA * d * d);
        if (!(vv_new < INFINITY)) vv_new = 1e300;
        double vfloor = 1e-12 * (am_new > 1e-12 ? am_new : 1e-12);
        double lg = log(vv_new > vfloor ? vv_new : vfloor);
        if (n >= WARMUP) {
            double best;
            /* EWMA spike band (weight 0.9) */
            resid = res1 > 0.0 ? res1 : -res1;
            raw = resid == 0.0 ? 0.0 : band_ratio(resid, 3.0 * rs1, lv1);
            best = top_ratio(0.0, raw, r0, W0);
            r0 = decay_record(r0, raw);
            /* level shift on the 48-value mean */
            resid = res2 > 0.0 ? res2 : -res2;
            raw = resid == 0.0 ? 0.0 : band_ratio(resid, 3.0 * rs2, lv2);
            best = top_ratio(best, raw, r1, 1.0);
            r1 = decay_record(r1, raw);
            /* variance change: log of the short variance, floor from |x| before x */
            floor_ = 1e-12 * (am > 1e-12 ? am : 1e-12);
            if (vv_new > floor_) {
                dev = (vv_new > vfloor ? lg : log(vv_new)) - lm;
            } else {
                dev = log(floor_) - lm;
            }
            if (dev < 0.0) dev = -dev;
            raw = dev == 0.0 ? 0.0 : band_ratio(dev, 3.0 * lsd, 0.0); /* floor 1e-12 */
            best = top_ratio(best, raw, r2, 1.0);
            r2 = decay_record(r2, raw);
            /* median / MAD band */
            {
                const double *s = self->sorted;
                Py_ssize_t ln = self->nsorted, mid = ln >> 1;
                double med = (ln & 1) ? s[mid] : 0.5 * (s[mid - 1] + s[mid]);
                dev = x - med;
                if (dev < 0.0) dev = -dev;
                raw = dev == 0.0 ? 0.0 : band_ratio(dev, band, med);
            }
            best = top_ratio(best, raw, r3, 1.0);
            r3 = decay_record(r3, raw);
            /* CUSUM (weight 0.9) */
            {
                double top = pos > neg ? pos : neg;
                raw = top <= 0.0 ? 0.0 : top / HH;
                if (!(raw < 1e9)) raw = 1e9;
            }
            best = top_ratio(best, raw, r4, W4);
            r4 = decay_record(r4, raw);
            /* daily pattern: the difference (0.6) and its 48-value mean (0.9) */
            double raw6 = 0.0;
            raw = 0.0;
            if (ns >= SEASONAL_MIN) {
                dev = y5 - m5;
                if (dev < 0.0) dev = -dev;
                if (dev != 0.0) {
                    raw = band_ratio(dev, 3.0 * s5, m5);
                    best = top_ratio(best, raw, r5, W5);
                }
                dev = y6 - m6;
                if (dev < 0.0) dev = -dev;
                if (dev != 0.0) {
                    raw6 = band_ratio(dev, 3.0 * s6, m6);
                    best = top_ratio(best, raw6, r6, W6);
                }
            }
            r5 = decay_record(r5, raw);
            r6 = decay_record(r6, raw6);
            score = best < INFINITY ? best / (1.0 + best) : 1.0;
        }
        /* learn, EWMA views */
        d = res1 - rm1;
        rm1 = rm1 + ra * d;
        rv1 = rb * (rv1 + ra * d * d);
        if (!(rv1 < INFINITY)) { rm1 = res1; rv1 = 1e300; }
        rs1 = sqrt(rv1);
        lv1 = lv1 + a * res1;
        d = res2 - rm2;
        rm2 = rm2 + ra * d;
        rv2 = rb * (rv2 + ra * d * d);
        if (!(rv2 < INFINITY)) { rm2 = res2; rv2 = 1e300; }
        rs2 = sqrt(rv2);
        sm2 = y2;
        lv2 = lv2 + a * res2;
        /* variance change: long-run EW mean / std of the log-variance */
        d = lg - lm;
        lm = lm + ra * d;
        lvv = rb * (lvv + ra * d * d);
        lsd = sqrt(lvv);
        vm = vm_new;
        vv = vv_new;
    } else {
        lv1 = sm2 = lv2 = vm = x;
    }
    am = am_new;
    /* CUSUM */
    if (n >= CUSUM_MIN) {
        if (pos > HH || neg > HH) pos = neg = 0.0;
        cp = pos > 0.0 ? pos : 0.0;
        cn = neg > 0.0 ? neg : 0.0;
    }
    d = x - cm;
    cm = cm + ac * d;
    cv = (1.0 - ac) * (cv + ac * d * d);
    if (!(cv < INFINITY)) { cm = x; cv = 1e300; }
    cs = sqrt(cv);
    /* seasonal views */
    if (ns >= 0) {
        double a5, b5;
        if (ns > STEADY) {
            a5 = 0.0003;
            b5 = RB;
        } else {
            a5 = 1.0 / (double)(ns + 1);
            if (a5 < 0.0003) a5 = 0.0003;
            b5 = 1.0 - a5;
        }
        d = y5 - m5;
        m5 = m5 + a5 * d;
        v5 = b5 * (v5 + a5 * d * d);
        if (!(v5 < INFINITY)) { m5 = isfinite(y5) ? y5 : 0.0; v5 = 1e300; }
        s5 = sqrt(v5);
        sm6 = y6;
        d = y6 - m6;
        m6 = m6 + a5 * d;
        v6 = b5 * (v6 + a5 * d * d);
        if (!(v6 < INFINITY)) { m6 = isfinite(y6) ? y6 : 0.0; v6 = 1e300; }
        s6 = sqrt(v6);
    }
    double nv[NF] = {r0, r1, r2, r3, r4, r5, r6,
                     lv1, rm1, rv1, rs1,
                     sm2, lv2, rm2, rv2, rs2,
                     vm, vv, lm, lvv, lsd, am,
                     cm, cv, cs, cp, cn,
                     m5, v5, s5,
                     sm6, m6, v6, s6,
                     band};
    memcpy(out, nv, sizeof nv);
    return score;
}

/* ------------------------------------------------------------------ the type */

static void free_buffers(BestCore *self);

static int alloc_buffers(BestCore *self, Py_ssize_t period) {
    free_buffers(self);
    self->fifo = PyMem_Malloc(sizeof(double) * ROBUST_WINDOW);
    self->sorted = PyMem_Malloc(sizeof(double) * ROBUST_WINDOW);
    self->past = PyMem_Malloc(sizeof(double) * (size_t)period);
    if (!self->fifo || !self->sorted || !self->past) {
        free_buffers(self);
        PyErr_NoMemory();
        return -1;
    }
    self->period = period;
    return 0;
}

static void reset(BestCore *self) {
    self->n = 0;
    memset(self->v, 0, sizeof self->v);
    self->nsorted = 0;
    self->since_mad = 0;
    self->rec_head = self->rec_len = 0;
    self->has_next = 0;
}

static int BestCore_init(BestCore *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"period", NULL};
    Py_ssize_t period = 288;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n", kwlist, &period)) return -1;
    if (period < 1) {
        PyErr_Format(PyExc_ValueError, "period must be >= 1, got %zd", period);
        return -1;
    }
    if (alloc_buffers(self, period) < 0) return -1;
    reset(self);
    return 0;
}

static void BestCore_dealloc(BestCore *self) {
    free_buffers(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ready(BestCore *self) {
    if (!self->fifo) {
        PyErr_SetString(PyExc_RuntimeError,
                        "Best detector has no state: call __init__ or __setstate__ first");
        return 0;
    }
    return 1;
}

static PyObject *BestCore_score_one(BestCore *self, PyObject *arg) {
    double x;
    int r = as_double(arg, &x);
    if (r < 0) return NULL;
    if (r > 0 || !isfinite(x) || self->n < WARMUP) return PyFloat_FromDouble(0.0);
    if (!ready(self)) return NULL;
    double score;
    if (self->has_next && memcmp(&self->next_x, &x, sizeof x) == 0) {
        score = self->next_score;
    } else {
        score = step(self, x, self->next_v);
        self->next_x = x;
        self->next_score = score;
        self->has_next = 1;
    }
    if (self->rec_len) { /* refractory_gate */
        long long horizon = self->n - REFRACTORY - 1;
        for (int i = 0; i < self->rec_len; i++) {
            int k = (self->rec_head + i) % RCAP;
            if (self->rec_idx[k] > horizon) {
                if (score <= self->rec_sc[k]) score = 0.0;
                break;
            }
        }
    }
    return PyFloat_FromDouble(score);
}

static PyObject *BestCore_learn_one(BestCore *self, PyObject *arg) {
    double x;
    int r = as_double(arg, &x);
    if (r < 0) return NULL;
    if (r > 0 || !isfinite(x)) Py_RETURN_NONE;
    if (!ready(self)) return NULL;
    double score;
    if (!(self->has_next && memcmp(&self->next_x, &x, sizeof x) == 0)) {
        score = step(self, x, self->next_v);
    } else {
        score = self->next_score;
    }
    self->has_next = 0;
    long long n = self->n;
    /* refractory_push */
    long long horizon = n - REFRACTORY;
    while (self->rec_len && self->rec_idx[self->rec_head] <= horizon) {
        self->rec_head = (self->rec_head + 1) % RCAP;
        self->rec_len--;
    }
    while (self->rec_len && self->rec_sc[(self->rec_head + self->rec_len - 1) % RCAP] <= score)
        self->rec_len--;
    {
        int k = (self->rec_head + self->rec_len) % RCAP;
        self->rec_idx[k] = n;
        self->rec_sc[k] = score;
        self->rec_len++;
    }
    /* median / MAD window */
    double *s = self->sorted;
    Py_ssize_t slot = (Py_ssize_t)(n % ROBUST_WINDOW);
    if (n >= ROBUST_WINDOW) {
        Py_ssize_t i = bisect_left(s, self->nsorted, self->fifo[slot]);
        if (i >= self->nsorted) { /* only a corrupted state: the oldest value is not there */
            PyErr_SetString(PyExc_ValueError, "Best state is inconsistent (the window lacks its "
                            "oldest value); start a fresh detector");
            return NULL;
        }
        memmove(s + i, s + i + 1, sizeof(double) * (size_t)(self->nsorted - i - 1));
        self->nsorted--;
    }
    self->fifo[slot] = x;
    {
        Py_ssize_t i = bisect_right(s, self->nsorted, x);
        memmove(s + i + 1, s + i, sizeof(double) * (size_t)(self->nsorted - i));
        s[i] = x;
        self->nsorted++;
    }
    long long since = self->since_mad + 1;
    Py_ssize_t n8 = self->nsorted >> 3;
    if (since >= (n8 > REFRESH ? REFRESH : (n8 > 1 ? n8 : 1))) {
        int err;
        double mad = mad_of_sorted(s, self->nsorted, &err);
        if (err) return NULL; /* state left as before this value's statistics */
        self->next_v[BAND] = KMAD * mad;
        since = 0;
    }
    self->since_mad = since;
    self->past[n % self->period] = x;
    memcpy(self->v, self->next_v, sizeof self->v);
    self->n = n + 1;
    Py_RETURN_NONE;
}

/* The state as PyBest's __dict__ holds it (best.py pickles this dict). */
static PyObject *BestCore_export(BestCore *self, PyObject *Py_UNUSED(ignored)) {
    if (!ready(self)) return NULL;
    PyObject *v = NULL, *fifo = NULL, *srt = NULL, *past = NULL, *recent = NULL, *tmp = NULL,
             *out = NULL;
    long long n = self->n;
    Py_ssize_t nw = self->nsorted;
    Py_ssize_t np_ = n < self->period ? (Py_ssize_t)n : self->period;
    if (!(v = PyList_New(NF))) goto done;
    for (int i = 0; i < NF; i++) {
        PyObject *f = PyFloat_FromDouble(self->v[i]);
        if (!f) goto done;
        PyList_SET_ITEM(v, i, f);
    }
    if (!(srt = PyList_New(nw))) goto done;
    for (Py_ssize_t i = 0; i < nw; i++) {
        PyObject *f = PyFloat_FromDouble(self->sorted[i]);
        if (!f) goto done;
        PyList_SET_ITEM(srt, i, f);
    }
    if (!(tmp = PyList_New(nw))) goto done;
    for (Py_ssize_t i = 0; i < nw; i++) { /* oldest first: value n - nw + i */
        PyObject *f = PyFloat_FromDouble(self->fifo[(n - nw + i) % ROBUST_WINDOW]);
        if (!f) goto done;
        PyList_SET_ITEM(tmp, i, f);
    }
    if (!(fifo = PyObject_CallOneArg(deque_type, tmp))) goto done;
    Py_CLEAR(tmp);
    if (!(tmp = PyList_New(np_))) goto done;
    for (Py_ssize_t i = 0; i < np_; i++) {
        PyObject *f = PyFloat_FromDouble(self->past[(n - np_ + i) % self->period]);
        if (!f) goto done;
        PyList_SET_ITEM(tmp, i, f);
    }
    {
        PyObject *maxlen = PyLong_FromSsize_t(self->period);
        if (!maxlen) goto done;
        past = PyObject_CallFunctionObjArgs(deque_type, tmp, maxlen, NULL);
        Py_DECREF(maxlen);
        if (!past) goto done;
    }
    Py_CLEAR(tmp);
    if (!(tmp = PyList_New(self->rec_len))) goto done;
    for (int i = 0; i < self->rec_len; i++) {
        int k = (self->rec_head + i) % RCAP;
        PyObject *t = Py_BuildValue("(Ld)", self->rec_idx[k], self->rec_sc[k]);
        if (!t) goto done;
        PyList_SET_ITEM(tmp, i, t);
    }
    if (!(recent = PyObject_CallOneArg(deque_type, tmp))) goto done;
    out = Py_BuildValue("{s:n,s:L,s:O,s:O,s:O,s:L,s:O,s:O}",
                        "period", self->period, "_n", n, "_v", v, "_fifo", fifo,
                        "_sorted", srt, "_since_mad", self->since_mad, "_past", past,
                        "_recent", recent);
done:
    Py_XDECREF(v);
    Py_XDECREF(fifo);
    Py_XDECREF(srt);
    Py_XDECREF(past);
    Py_XDECREF(recent);
    Py_XDECREF(tmp);
    return out;
}

static int fill_doubles(PyObject *seq, double *dst, Py_ssize_t want, const char *name) {
    PyObject *fast = PySequence_Fast(seq, "Best state: a sequence was expected");
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != want) {
        PyErr_Format(PyExc_ValueError, "Best state: %s has %zd values, expected %zd; "
                     "start a fresh detector", name, PySequence_Fast_GET_SIZE(fast), want);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        double x = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
        if (x == -1.0 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
        dst[i] = x;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *item(PyObject *state, const char *key) {
    PyObject *o = PyDict_GetItemString(state, key); /* borrowed */
    if (!o) PyErr_Format(PyExc_ValueError, "Best state lacks %s; start a fresh detector", key);
    return o;
}

static void free_buffers(BestCore *self) {
    PyMem_Free(self->fifo);
    PyMem_Free(self->sorted);
    PyMem_Free(self->past);
    self->fifo = self->sorted = self->past = NULL;
}

static PyObject *import_state(BestCore *self, PyObject *state);

/* Load the dict PyBest pickles (validated by best.py's check_layout first). A state that
 * does not load leaves the detector without state (every use then says so), never half
 * loaded. */
static PyObject *BestCore_import(BestCore *self, PyObject *state) {
    PyObject *r = import_state(self, state);
    if (!r) free_buffers(self);
    return r;
}

static PyObject *import_state(BestCore *self, PyObject *state) {
    if (!PyDict_Check(state)) {
        PyErr_SetString(PyExc_TypeError, "Best state must be a dict");
        return NULL;
    }
    PyObject *o;
    if (!(o = item(state, "period"))) return NULL;
    Py_ssize_t period = PyLong_AsSsize_t(o);
    if (period == -1 && PyErr_Occurred()) return NULL;
    if (period < 1) return PyErr_Format(PyExc_ValueError, "period must be >= 1, got %zd", period);
    if (!(o = item(state, "_n"))) return NULL;
    long long n = PyLong_AsLongLong(o);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "Best state: _n = %lld < 0; start a fresh "
                                   "detector", n);
    if (alloc_buffers(self, period) < 0) return NULL;
    reset(self);
    self->n = n;
    if (!(o = item(state, "_v")) || fill_doubles(o, self->v, NF, "_v") < 0) return NULL;
    Py_ssize_t nw = n < ROBUST_WINDOW ? (Py_ssize_t)n : ROBUST_WINDOW;
    if (!(o = item(state, "_sorted")) || fill_doubles(o, self->sorted, nw, "_sorted") < 0)
        return NULL;
    self->nsorted = nw;
    double *tmp = PyMem_Malloc(sizeof(double) * (size_t)(nw > period ? nw : period) + 1);
    if (!tmp) return PyErr_NoMemory();
    if (!(o = item(state, "_fifo")) || fill_doubles(o, tmp, nw, "_fifo") < 0) goto fail;
    for (Py_ssize_t i = 0; i < nw; i++) self->fifo[(n - nw + i) % ROBUST_WINDOW] = tmp[i];
    Py_ssize_t np_ = n < period ? (Py_ssize_t)n : period;
    if (!(o = item(state, "_past")) || fill_doubles(o, tmp, np_, "_past") < 0) goto fail;
    for (Py_ssize_t i = 0; i < np_; i++) self->past[(n - np_ + i) % period] = tmp[i];
    PyMem_Free(tmp);
    tmp = NULL;
    if (!(o = item(state, "_since_mad"))) return NULL;
    self->since_mad = PyLong_AsLongLong(o);
    if (self->since_mad == -1 && PyErr_Occurred()) return NULL;
    if (!(o = item(state, "_recent"))) return NULL;
    PyObject *fast = PySequence_Fast(o, "Best state: _recent must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t nr = PySequence_Fast_GET_SIZE(fast);
    if (nr > RCAP) {
        Py_DECREF(fast);
        return PyErr_Format(PyExc_ValueError, "Best state: _recent has %zd entries; "
                            "start a fresh detector", nr);
    }
    for (Py_ssize_t i = 0; i < nr; i++) {
        long long idx;
        double sc;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "Ld", &idx, &sc)) {
            Py_DECREF(fast);
            return NULL;
        }
        self->rec_idx[i] = idx;
        self->rec_sc[i] = sc;
    }
    Py_DECREF(fast);
    self->rec_len = (int)nr;
    Py_RETURN_NONE;
fail:
    PyMem_Free(tmp);
    return NULL;
}

static PyObject *BestCore_get_period(BestCore *self, void *closure) {
    return PyLong_FromSsize_t(self->period);
}

static PyObject *BestCore_get_n(BestCore *self, void *closure) {
    return PyLong_FromLongLong(self->n);
}

/* ------------------------------------------------------------------ HalfSpaceTrees */

/* detectors.halfspace.HalfSpaceTrees._leaves: the flat leaf index of ``scaled`` in every
 * tree, each a walk of ``height`` splits (feat: per tree the split feature of each internal
 * node in heap order, thr: its threshold). */
static PyObject *hst_leaves(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "hst_leaves(scaled, feat, thr, height)");
        return NULL;
    }
    PyObject *scaled = args[0], *feat = args[1], *thr = args[2];
    long height = PyLong_AsLong(args[3]);
    if (height == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_Check(scaled) || !PyList_Check(feat) || !PyList_Check(thr) ||
        PyList_GET_SIZE(feat) != PyList_GET_SIZE(thr) || height < 1 || height > 30) {
        PyErr_SetString(PyExc_TypeError, "hst_leaves: lists of equal length and 1 <= height <= 30");
        return NULL;
    }
    Py_ssize_t n_trees = PyList_GET_SIZE(feat), n_feat = PyList_GET_SIZE(scaled);
    Py_ssize_t first_leaf = ((Py_ssize_t)1 << height) - 1;
    double vals[64];
    double *x = n_feat <= 64 ? vals : PyMem_Malloc(sizeof(double) * (size_t)(n_feat + 1));
    if (!x) return PyErr_NoMemory();
    for (Py_ssize_t j = 0; j < n_feat; j++) {
        x[j] = PyFloat_AsDouble(PyList_GET_ITEM(scaled, j));
        if (x[j] == -1.0 && PyErr_Occurred()) goto fail;
    }
    PyObject *out = PyList_New(n_trees);
    if (!out) goto fail;
    Py_ssize_t base = -first_leaf;
    for (Py_ssize_t t = 0; t < n_trees; t++) {
        PyObject *f = PyList_GET_ITEM(feat, t), *h = PyList_GET_ITEM(thr, t);
        if (!PyList_Check(f) || !PyList_Check(h) || PyList_GET_SIZE(f) < first_leaf ||
            PyList_GET_SIZE(h) < first_leaf) {
            PyErr_SetString(PyExc_ValueError, "hst_leaves: a tree has fewer nodes than its height needs");
            Py_DECREF(out);
            goto fail;
        }
        Py_ssize_t i = 0;
        for (long k = 0; k < height; k++) {
            Py_ssize_t j = PyLong_AsSsize_t(PyList_GET_ITEM(f, i));
            if (j < 0 || j >= n_feat) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_IndexError, "hst_leaves: split feature out of range");
                Py_DECREF(out);
                goto fail;
            }
            double th = PyFloat_AsDouble(PyList_GET_ITEM(h, i));
            if (th == -1.0 && PyErr_Occurred()) { Py_DECREF(out); goto fail; }
            i = x[j] < th ? 2 * i + 1 : 2 * i + 2;
        }
        PyObject *leaf = PyLong_FromSsize_t(base + i);
        if (!leaf) { Py_DECREF(out); goto fail; }
        PyList_SET_ITEM(out, t, leaf);
        base += first_leaf + 1;
    }
    if (x != vals) PyMem_Free(x);
    return out;
fail:
    if (x != vals) PyMem_Free(x);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"hst_leaves", (PyCFunction)(void (*)(void))hst_leaves, METH_FASTCALL,
     "HalfSpaceTrees._leaves compiled: the leaf of scaled in every tree."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef BestCore_methods[] = {
    {"score_one", (PyCFunction)BestCore_score_one, METH_O,
     "How anomalous x is, in [0, 1); 0.0 before the warm-up and for non-finite x."},
    {"learn_one", (PyCFunction)BestCore_learn_one, METH_O,
     "Fold one value into the state (non-finite values are ignored)."},
    {"_export", (PyCFunction)BestCore_export, METH_NOARGS,
     "The state as the pure-Python PyBest's __dict__."},
    {"_import", (PyCFunction)BestCore_import, METH_O,
     "Load a state exported by _export or pickled by PyBest."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef BestCore_getset[] = {
    {"period", (getter)BestCore_get_period, NULL, "values per day", NULL},
    {"_n", (getter)BestCore_get_n, NULL, "finite values learned", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BestCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "detectors._bestc.BestCore",
    .tp_doc = "The fused best detector's state and update in C (see detectors.best.Best).",
    .tp_basicsize = sizeof(BestCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)BestCore_init,
    .tp_dealloc = (destructor)BestCore_dealloc,
    .tp_methods = BestCore_methods,
    .tp_getset = BestCore_getset,
};

static struct PyModuleDef bestc_module = {
    PyModuleDef_HEAD_INIT, "detectors._bestc",
    "The fused best detector compiled (detectors/best.py holds the Python reference), and\n"
    "HalfSpaceTrees' tree walk (detectors/halfspace.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__bestc(void) {
    PyObject *stats = PyImport_ImportModule("detectors._stats");
    if (!stats) return NULL;
    fsum_func = PyObject_GetAttrString(stats, "exact_sum");
    Py_DECREF(stats);
    if (!fsum_func) return NULL;
    PyObject *coll = PyImport_ImportModule("collections");
    if (!coll) return NULL;
    deque_type = PyObject_GetAttrString(coll, "deque");
    Py_DECREF(coll);
    if (!deque_type) return NULL;
    if (PyType_Ready(&BestCoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&bestc_module);
    if (!m) return NULL;
    Py_INCREF(&BestCoreType);
    if (PyModule_AddObject(m, "BestCore", (PyObject *)&BestCoreType) < 0) {
        Py_DECREF(&BestCoreType);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *consts = Py_BuildValue(
        "(ddiiiiidddiiiddddddd)", SLOW, DECAY, WARMUP, REFRACTORY, SMOOTH, SHORT,
        ROBUST_WINDOW, KK, CUSUM_ALPHA, DRIFT, CUSUM_MIN, SEASONAL_MIN, STEADY, HH,
        SCORE_CAP, MAD_TO_STD, W0, W4, W5, W6);
    if (!consts || PyModule_AddObject(m, "CONSTANTS", consts) < 0) {
        Py_XDECREF(consts);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *fields = PyTuple_New(NF);
    if (!fields) { Py_DECREF(m); return NULL; }
    for (int i = 0; i < NF; i++) {
        PyObject *name = PyUnicode_FromString(FIELD_NAMES[i]);
        if (!name) { Py_DECREF(fields); Py_DECREF(m); return NULL; }
        PyTuple_SET_ITEM(fields, i, name);
    }
    if (PyModule_AddObject(m, "FIELDS", fields) < 0) {
        Py_DECREF(fields);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
