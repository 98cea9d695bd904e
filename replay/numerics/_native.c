/* The server's pre-sampling probabilities of one logits row, in C: recover and trace call this once
 * per generated token, between two decodes, so its cost is their overhead over raw decoding.
 *
 * What it reproduces (replay/numerics/server_probs.py has the rule in numpy, and
 * `reference_probabilities` the direct computation the tests compare this with):
 * get_token_probabilities (tools/server/server-common.cpp:1591-1641) std::partial_sorts the
 * (id, logit) entries of the vocabulary by `a.logit > b.logit` up to n_top, sums expf(logit - max)
 * sequentially in float in the order partial_sort left the array, and divides each term by the sum;
 * populate_token_probs (server-context.cpp:2129-2150) reports the sampled token's p and the first
 * n_top entries in that order; completion_token_output::logarithm (server-task.cpp:302-305) takes
 * their float log, 0 giving the lowest float.
 *
 * partial_sort is followed step by step as libstdc++ takes it (bits/stl_algo.h __partial_sort,
 * bits/stl_heap.h), so equal logits come out in the server's order. Only entries above max - 17
 * can move a float sum that already holds expf(0) = 1 (their terms are below half an ulp of 1), so
 * only those are exponentiated.
 *
 * Returns None for the rows this does not take (no top-N requested, a non-finite or huge logit):
 * the caller computes those directly.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>

static const float NO_EFFECT = -17.0f; /* server_probs._NO_EFFECT */

/* the heap part of the array: n_top (logit, id) entries */
static float *hk;
static Py_ssize_t *hid, cap_top;
/* the logits of the rest, as the scan leaves them, that can move the sum */
static float *rest;
static Py_ssize_t cap_n;

static int reserve(Py_ssize_t n, Py_ssize_t n_top) {
    if (n > cap_n) {
        free(rest);
        rest = malloc(sizeof(*rest) * n);
        cap_n = rest ? n : 0;
        if (!rest) { PyErr_NoMemory(); return -1; }
    }
    if (n_top > cap_top) {
        free(hk); free(hid);
        hk = malloc(sizeof(*hk) * n_top);
        hid = malloc(sizeof(*hid) * n_top);
        cap_top = hk && hid ? n_top : 0;
        if (!hk || !hid) { PyErr_NoMemory(); return -1; }
    }
    return 0;
}

/* std::__adjust_heap then std::__push_heap with comp(a, b) = a.logit > b.logit */
static void adjust_heap(Py_ssize_t hole, Py_ssize_t len, float key, Py_ssize_t id) {
    const Py_ssize_t top = hole;
    Py_ssize_t second = hole;
    while (second < (len - 1) / 2) {
        second = 2 * (second + 1);
        if (hk[second] > hk[second - 1]) second--;
        hk[hole] = hk[second]; hid[hole] = hid[second];
        hole = second;
    }
    if ((len & 1) == 0 && second == (len - 2) / 2) {
        second = 2 * (second + 1);
        hk[hole] = hk[second - 1]; hid[hole] = hid[second - 1];
        hole = second - 1;
    }
    Py_ssize_t parent = (hole - 1) / 2;
    while (hole > top && hk[parent] > key) {
        hk[hole] = hk[parent]; hid[hole] = hid[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    hk[hole] = key; hid[hole] = id;
}

static double server_log(float p) {
    return p == 0.0f ? -FLT_MAX : (double)logf(p);
}

static PyObject *pre_sampling(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t tok, n_top;
    if (!PyArg_ParseTuple(args, "Onn", &obj, &tok, &n_top)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    PyObject *out = NULL;
    const char *f = view.format ? view.format : "";
    if (f[0] == '@' || f[0] == '=' || (PY_LITTLE_ENDIAN && f[0] == '<')) ++f;  /* native float32 */
    if (view.itemsize != 4 || f[0] != 'f' || f[1] != '\0') {
        PyErr_SetString(PyExc_TypeError, "logits must be a contiguous float32 buffer");
        goto done;
    }
    const float *l = view.buf;
    const Py_ssize_t n = view.len / 4;
    if (n == 0 || tok < 0 || tok >= n) {
        PyErr_SetString(PyExc_IndexError, "token id outside the logits row");
        goto done;
    }
    if (n_top > n) n_top = n;
    /* max, min and NaN in eight independent lanes (one chain of maxss is latency-bound) */
    float mxs[8], mns[8];
    int nans[8] = {0};
    for (int j = 0; j < 8; ++j) mxs[j] = mns[j] = l[0];
    const Py_ssize_t n8 = n - n % 8;
    for (Py_ssize_t i = 0; i < n8; i += 8)
        for (int j = 0; j < 8; ++j) {
            const float v = l[i + j];
            mxs[j] = v > mxs[j] ? v : mxs[j];
            mns[j] = v < mns[j] ? v : mns[j];
            nans[j] |= v != v;
        }
    for (Py_ssize_t i = n8; i < n; ++i) {
        mxs[0] = l[i] > mxs[0] ? l[i] : mxs[0];
        mns[0] = l[i] < mns[0] ? l[i] : mns[0];
        nans[0] |= l[i] != l[i];
    }
    float mx = mxs[0], mn = mns[0];
    int nan = nans[0] | (l[0] != l[0]);
    for (int j = 1; j < 8; ++j) {
        mx = mxs[j] > mx ? mxs[j] : mx;
        mn = mns[j] < mn ? mns[j] : mn;
        nan |= nans[j];
    }
    if (n_top <= 0 || nan || !(mx <= 1e5f) || !(mn >= -1e5f)) { out = Py_NewRef(Py_None); goto done; }
    if (reserve(n, n_top) < 0) goto done;

    /* __partial_sort: __make_heap over the first n_top ... */
    for (Py_ssize_t i = 0; i < n_top; ++i) { hk[i] = l[i]; hid[i] = i; }
    for (Py_ssize_t parent = (n_top - 2) / 2; n_top >= 2 && parent >= 0; --parent)
        adjust_heap(parent, n_top, hk[parent], hid[parent]);
    /* ... __heap_select: an entry above the heap's first takes its place (__pop_heap), the first
     * going where the entry was; the rest's logits that can move the sum are kept in order ... */
    const float thr = mx + NO_EFFECT;
    Py_ssize_t nr = 0;
    for (Py_ssize_t i = n_top; i < n; ++i) {
        float v = l[i];
        if (v > hk[0]) {
            const float first = hk[0];
            adjust_heap(0, n_top, v, i);
            v = first;
        }
        rest[nr] = v;  /* branch-free: few entries pass */
        nr += v > thr;
    }
    /* ... and __sort_heap */
    for (Py_ssize_t last = n_top - 1; last > 0; --last) {
        const float k = hk[last];
        const Py_ssize_t id = hid[last];
        hk[last] = hk[0]; hid[last] = hid[0];
        adjust_heap(0, last, k, id);
    }
    float total = 0.0f;  /* cum_sum += expf(logit - max_l), in the array's order */
    for (Py_ssize_t k = 0; k < n_top; ++k)
        if (hk[k] > thr) total += expf(hk[k] - mx);
    for (Py_ssize_t k = 0; k < nr; ++k) total += expf(rest[k] - mx);

    PyObject *top = PyList_New(n_top);
    if (!top) goto done;
    for (Py_ssize_t k = 0; k < n_top; ++k) {
        PyObject *pair = Py_BuildValue("(nd)", hid[k], server_log(expf(hk[k] - mx) / total));
        if (!pair) { Py_DECREF(top); goto done; }
        PyList_SET_ITEM(top, k, pair);
    }
    out = Py_BuildValue("(dN)", server_log(expf(l[tok] - mx) / total), top);
done:
    PyBuffer_Release(&view);
    return out;
}
static PyMethodDef methods[] = {
    {"pre_sampling", pre_sampling, METH_VARARGS,
     "pre_sampling(logits, tok, n_top) -> (logprob of tok, [(id, logprob)] * n_top), or None for a row to "
     "compute directly. `logits`: a contiguous float32 buffer of one vocabulary row."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
