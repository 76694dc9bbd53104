"""The LeetCode judge's preamble: what runs before a candidate solution and its tests.

:data:`integrations.data.problems.CODE_PRELUDE` is this file's text after this docstring; the code
sandbox runs it (:mod:`integrations.rl.sandbox`), nothing imports it. The LeetCode tests call
``tree_node``, ``list_node``, ``is_same_tree`` and ``is_same_list``, and the problems' code stubs
use ``List``, ``Optional``, ``TreeNode`` and ``ListNode`` without importing them (the LeetCode
judge provides them). Mirrors the preamble of LeetCodeDataset (newfacade/LeetCodeDataset). The
star imports' order matters (a later one's names win), so the imports stay as the judge has them.
"""
import bisect, collections, datetime, functools, heapq, itertools, math, operator, random, re, string, sys
from typing import *
from bisect import *
from collections import *
from functools import *
from heapq import *
from itertools import *
from math import *
from operator import *
from string import *
try:
    from sortedcontainers import SortedDict, SortedList, SortedSet
except ImportError:
    pass
sys.setrecursionlimit(100000)
inf = float("inf")


class ListNode:
    def __init__(self, val=0, next=None):
        self.val = val
        self.next = next


def list_node(values):
    if not values:
        return None
    head = ListNode(values[0])
    p = head
    for val in values[1:]:
        p.next = ListNode(val)
        p = p.next
    return head


def is_same_list(p1, p2):
    while p1 is not None and p2 is not None:
        if p1.val != p2.val:
            return False
        p1, p2 = p1.next, p2.next
    return p1 is None and p2 is None


class TreeNode:
    def __init__(self, val=0, left=None, right=None):
        self.val = val
        self.left = left
        self.right = right


def tree_node(values):
    if not values:
        return None
    root = TreeNode(values[0])
    i = 1
    queue = collections.deque([root])
    while queue:
        node = queue.popleft()
        if i < len(values) and values[i] is not None:
            node.left = TreeNode(values[i])
            queue.append(node.left)
        i += 1
        if i < len(values) and values[i] is not None:
            node.right = TreeNode(values[i])
            queue.append(node.right)
        i += 1
    return root


def is_same_tree(p, q):
    if not p and not q:
        return True
    if not p or not q or p.val != q.val:
        return False
    return is_same_tree(p.left, q.left) and is_same_tree(p.right, q.right)
